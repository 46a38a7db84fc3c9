"""Checkers: how the sweeper asks whether an UNKNOWN message's local transaction committed.

A checker is a Python callable registered on an ``Outbox`` for its producer group
(``@outbox.checker("orders")``), or a SQL query over the business tables declared in
``OUTBOX_SQL_CHECKERS`` so that a sweeper needs no application code. Either answers
COMMIT, ROLLBACK or UNKNOWN (None counts as UNKNOWN), like RocketMQ's checkLocalTransaction.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from outbox import store
from outbox.exceptions import ConfigurationError
from outbox.message import Message
from outbox.schema import Resolution

#: ``checker(message, connection)``; the connection is in a read-only transaction whose
#: statements are cut off at the checker timeout.
Checker = Callable[[Message, Connection], Any]


def synchronous(checker: Any, group: str) -> Checker:
    """``checker`` if the sweeper can call it: a coroutine function (``async def``, also
    behind ``functools.partial`` or a ``__call__``) answers a coroutine nothing awaits, so
    every check would count as inconclusive until the message is discarded."""
    if not callable(checker):
        raise ConfigurationError(f"the checker of producer group {group!r} is not callable: "
                                 f"{checker!r}")
    if is_coroutine_function(checker):
        raise ConfigurationError(
            f"the checker of producer group {group!r} is a coroutine function: checkers run "
            "on the sweeper's threads and must be plain functions (def, not async def)")
    try:
        inspect.signature(checker).bind(None, None)
    except TypeError as exc:  # every call would raise it: inconclusive, then discarded
        raise ConfigurationError(
            f"the checker of producer group {group!r} cannot be called as "
            f"checker(message, connection): {exc}") from None
    except ValueError:  # no signature to read (some built-ins): the first check tells
        pass
    return checker  # type: ignore[no-any-return]


def is_coroutine_function(func: Callable[..., object]) -> bool:
    """Whether calling ``func`` only makes a coroutine: ``async def``, also behind
    ``functools.partial`` or as an object's own ``__call__``."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        type(func).__call__)


def to_resolution(answer: object, who: str) -> Resolution:
    """The resolution a local transaction or checker answered; a wrong type is a bug in it."""
    if answer is None:
        return Resolution.UNKNOWN
    if isinstance(answer, str) and answer.strip().upper() in Resolution.__members__:
        return Resolution(answer.strip().upper())
    raise TypeError(f"{who} answered {described(answer)}; answer COMMIT, ROLLBACK or UNKNOWN "
                    "(or None)")


def described(answer: object) -> str:
    """A wrong answer by its type and length, never its content: it is logged and recorded,
    and a checker's answer may be the payload it was given (``SELECT :payload``)."""
    kind = f"a value of type {type(answer).__name__}"
    try:
        return f"{kind} (length {len(answer)})"  # type: ignore[arg-type]
    except Exception:  # no length, or its __len__ fails: the type says enough
        return kind


@dataclass(frozen=True, slots=True)
class SqlChecker:
    """A checker that is one query, e.g. ``SELECT CASE WHEN paid THEN 'COMMIT' END ...``.

    Binds: ``:id``, ``:producer_group``, ``:topic``, ``:key`` and ``:payload`` (text; use
    ``CAST(:payload AS jsonb)``), ``:check_count``. The first column of the first row is the
    answer; no row or NULL is UNKNOWN. It runs as the role ``<schema>_checker``, in the
    read-only transaction of the check, sent so that PostgreSQL refuses a second statement
    (see ``create_checker_role`` in sql/queries.sql); an unknown bind raises ValueError here.
    """

    sql: str
    schema: str
    #: ``sql`` with positional binds, as it is prepared.
    statement: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "statement", store.positional_checker(self.sql))

    def __call__(self, message: Message, conn: Connection) -> Any:
        return store.run_sql_checker(conn, self.schema, self.statement, message)
