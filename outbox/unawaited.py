"""A commit is refused while an async ``publish``, ``prepare`` or decision was never awaited.

``outbox.publish(async_session, ...)`` returns a coroutine: without ``await`` it writes
nothing, and Python warns only when the coroutine is garbage-collected, after the business
rows committed without their message. So the call records itself on the SQLAlchemy session
or connection as it is made, its coroutine's first step strikes it off, and a commit while
one is recorded raises :class:`NotAwaited`: the business rows roll back with the message
that was never written. A call cancelled before it completed (``wait_for`` timing out, a
request task cancelled: before its first step, waiting for a pooled connection, or while its
statement ran) may have written nothing either: it refuses the commit of the transaction it
was made in, and is forgotten if it was made outside any (a later transaction is not its). A
psycopg ``AsyncConnection`` has no hook before its commit: there only the warning, and a
type checker (mypy's ``unused-coroutine``), can tell.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

from sqlalchemy import Connection, NestedTransaction, event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, SessionTransaction

from outbox.connectors import autocommit_mode
from outbox.exceptions import NotAwaited

T = TypeVar("T")

#: The calls not yet started, by the session or connection they will run on.
_pending: weakref.WeakKeyDictionary[Session | Connection, list[_Call]] = (
    weakref.WeakKeyDictionary())


def recorded(bind: object, call: str, coroutine: Coroutine[Any, Any, T]
             ) -> Coroutine[Any, Any, T]:
    """``coroutine`` of ``call`` (``publish() to topic 'orders'``), recorded on ``bind``
    until it starts if a commit of it can be refused."""
    holder = _holder(bind)
    if holder is None:
        return coroutine
    calls = _pending.get(holder)
    if calls is None:
        calls = _pending[holder] = []
        _watch(holder, calls)
    pending = _Call(call, holder.get_nested_transaction())
    calls.append(pending)
    # in AUTOCOMMIT mode a call commits on its own: no transaction to leave without it
    in_transaction = holder.in_transaction() and not (
        isinstance(holder, Connection) and autocommit_mode(holder))
    return _Recorded(coroutine, calls, pending, in_transaction=in_transaction)


class _Call:
    """One call, struck off by identity (two equal calls are two calls); ``savepoint``: the
    innermost one it was made in, whose rollback drops it with the rest of that step."""

    __slots__ = ("savepoint", "state", "what")

    def __init__(self, what: str, savepoint: SessionTransaction | NestedTransaction | None
                 ) -> None:
        self.what = what
        self.savepoint = savepoint
        self.state = "was never awaited, so nothing of it was written"


class _Recorded(Coroutine[Any, Any, T]):
    """A call's coroutine, struck off as it starts. Cancelled, before it started (thrown into
    or closed by its task) or before it completed, it refuses the commit of the transaction
    it was made in (made outside any, it is forgotten); neither, it was never awaited."""

    __slots__ = ("_call", "_calls", "_coroutine", "_in_transaction", "_started", "_steps")

    def __init__(self, coroutine: Coroutine[Any, Any, T], calls: list[_Call], call: _Call,
                 *, in_transaction: bool) -> None:
        self._coroutine = coroutine
        self._calls = calls
        self._call = call
        self._in_transaction = in_transaction
        self._started = False
        self._steps = self._run()

    def _run(self) -> Generator[Any, Any, T]:
        self._strike()  # running: a commit it issues itself (an autocommit decision) is its
        try:
            return (yield from self._coroutine.__await__())
        except (asyncio.CancelledError, GeneratorExit):
            self._cancelled()
            raise

    def _strike(self) -> None:
        self._calls[:] = [other for other in self._calls if other is not self._call]

    def _cancelled(self) -> None:
        self._strike()
        if self._in_transaction:  # that transaction must not commit
            self._call.state = ("was cancelled before it completed, so its message may be "
                                "missing")
            self._calls.append(self._call)

    def _cancelled_before_start(self) -> None:
        if not self._started:
            self._started = True
            self._coroutine.close()  # never to run: no "never awaited" warning
            self._cancelled()

    def send(self, value: Any) -> Any:
        self._started = True
        return self._steps.send(value)

    def throw(self, *args: Any) -> Any:
        self._cancelled_before_start()
        return self._steps.throw(*args)

    def close(self) -> None:
        self._cancelled_before_start()
        self._steps.close()

    def __await__(self) -> Generator[Any, None, T]:
        self._started = True
        return self._steps


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
            """Committed, a savepoint released, with a call recorded: refused before this."""
            if transaction.parent is None:  # rolled back: nothing of it is written
                calls.clear()
            elif transaction.nested:
                calls[:] = [call for call in calls if call.savepoint is not transaction]

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

    def rollback_savepoint(conn: Connection, name: str, context: object) -> None:
        """Fired while the savepoint rolled back is still the innermost, and active."""
        rolled_back = conn.get_nested_transaction()
        calls[:] = [call for call in calls if call.savepoint is None or (
            call.savepoint is not rolled_back and call.savepoint.is_active)]

    event.listen(holder, "commit", commit)
    event.listen(holder, "rollback", rollback)
    event.listen(holder, "rollback_savepoint", rollback_savepoint)


def _refuse(calls: list[_Call]) -> None:
    if calls:
        more = f" (and {len(calls) - 1} more)" if len(calls) > 1 else ""
        raise NotAwaited(
            f"outbox {calls[0].what}{more} {calls[0].state}: the commit is refused, and "
            "nothing of this transaction is committed; await every "
            "publish, prepare, commit and rollback on an async session or connection, and "
            "roll back a transaction in which one was cancelled")
