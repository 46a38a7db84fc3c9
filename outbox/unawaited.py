"""A commit is refused while an async ``publish``, ``prepare`` or decision was never awaited.

``outbox.publish(async_session, ...)`` returns a coroutine: without ``await`` it writes
nothing, and Python warns only when the coroutine is garbage-collected, after the business
rows committed without their message. So the call records itself on the SQLAlchemy session or
connection as it is made, its coroutine's first step strikes it off, and a commit while one is
recorded raises :class:`NotAwaited`: the business rows roll back with the message that was
never written. A psycopg ``AsyncConnection`` has no hook before its commit: there only the
warning, and a type checker (mypy's ``unused-coroutine``), can tell.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from sqlalchemy import Connection, event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, SessionTransaction

from outbox.exceptions import NotAwaited

#: The calls not yet started, by the session or connection they will run on.
_pending: weakref.WeakKeyDictionary[Session | Connection, list[_Call]] = (
    weakref.WeakKeyDictionary())


def record(bind: object, call: str) -> Callable[[], None]:
    """Record ``call`` (``publish() to topic 'orders'``) on ``bind`` if a commit of it can be
    refused; returns what the coroutine runs first, to strike it off."""
    holder = _holder(bind)
    if holder is None:
        return _nothing
    calls = _pending.get(holder)
    if calls is None:
        calls = _pending[holder] = []
        _watch(holder, calls)
    pending = _Call(call)
    calls.append(pending)

    def started() -> None:
        calls[:] = [other for other in calls if other is not pending]

    return started


def _nothing() -> None:
    pass


class _Call:
    """One call, struck off by identity (two equal calls are two calls)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


def _holder(bind: object) -> Session | Connection | None:
    if isinstance(bind, async_scoped_session):
        bind = bind()
    if isinstance(bind, AsyncSession):
        return bind.sync_session
    if isinstance(bind, AsyncConnection):
        return bind.sync_connection  # None until started: the call will fail as it runs
    return None


def _watch(holder: Session | Connection, calls: list[_Call]) -> None:
    if isinstance(holder, Session):
        def before_commit(session: Session) -> None:
            _refuse(calls)

        def after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
            if transaction.parent is None:  # rolled back: nothing of it is written
                calls.clear()

        event.listen(holder, "before_commit", before_commit)  # a savepoint's release too
        event.listen(holder, "after_transaction_end", after_transaction_end)
        return

    def commit(conn: Connection) -> None:
        """Raised here, SQLAlchemy takes the transaction as ended, as after a failed COMMIT,
        and issues no ROLLBACK: the database's is rolled back first, so none stays open to
        be committed with the connection's next transaction."""
        if calls:
            conn.connection.rollback()
            try:
                _refuse(calls)
            finally:
                calls.clear()

    def rollback(conn: Connection) -> None:
        calls.clear()

    event.listen(holder, "commit", commit)
    event.listen(holder, "rollback", rollback)


def _refuse(calls: list[_Call]) -> None:
    if calls:
        more = f" (and {len(calls) - 1} more)" if len(calls) > 1 else ""
        raise NotAwaited(
            f"outbox {calls[0].what}{more} was never awaited, so nothing of it was written: "
            "the commit is refused, and nothing of this transaction is committed; await every "
            "publish, prepare, commit and rollback on an async session or connection")
