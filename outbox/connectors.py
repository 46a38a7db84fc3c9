"""Where ``publish``, ``prepare`` and decisions run: whatever connection the application holds.

SQLAlchemy sessions, connections and engines (psycopg 3, psycopg2, asyncpg; scoped sessions
such as Flask-SQLAlchemy's ``db.session``), plain psycopg 3 connections and Django's
connection. The statement is built once (store.py); this module only forks its execution,
and asks each kind of connection the same question: is there an open transaction that the
prepare row will share?
"""

from __future__ import annotations

import contextlib
import sys
from collections import namedtuple
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload, runtime_checkable

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.raw_cursor import RawCursorMixin
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Engine, TextClause
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
)
from sqlalchemy.orm import Session, scoped_session
from typing_extensions import TypeIs

from outbox import store
from outbox.exceptions import ConfigurationError, NotInTransaction


@runtime_checkable
class DjangoConnection(Protocol):
    """The part of Django's ``django.db.connection`` the outbox uses (Django not imported)."""

    vendor: str
    alias: str
    in_atomic_block: bool

    def get_autocommit(self) -> bool: ...
    def cursor(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class OwnTransaction:
    """A connection on which a call commits in a transaction of its own, like an engine."""

    connection: psycopg.Connection[Any] | DjangoConnection


@dataclass(frozen=True, slots=True)
class AsyncOwnTransaction:
    connection: psycopg.AsyncConnection[Any]


@dataclass(frozen=True, slots=True)
class Autocommitting:
    """A SQLAlchemy connection in ``AUTOCOMMIT`` mode on psycopg2 or asyncpg, where a
    decision's one statement commits on its own (psycopg 3's runs as an OwnTransaction)."""

    connection: Connection


@dataclass(frozen=True, slots=True)
class AsyncAutocommitting:
    connection: AsyncConnection


SyncTarget = (
    Session | Connection | scoped_session[Any] | psycopg.Connection[Any] | DjangoConnection
)
AsyncTarget = (
    AsyncSession | AsyncConnection | async_scoped_session[Any] | psycopg.AsyncConnection[Any]
)
SyncBind = SyncTarget | Engine | OwnTransaction | Autocommitting
AsyncBind = AsyncTarget | AsyncEngine | AsyncOwnTransaction | AsyncAutocommitting
Rows = Sequence[Any]
"""Result rows with attribute access (``row.decided``), whichever connection ran them."""

_ASYNC = (AsyncSession, AsyncConnection, AsyncEngine, async_scoped_session,
          psycopg.AsyncConnection, AsyncOwnTransaction, AsyncAutocommitting)


def is_async(bind: SyncBind | AsyncBind) -> TypeIs[AsyncBind]:
    return isinstance(bind, _ASYNC)


def unproxied(bind: Any) -> Any:
    """The connection behind Django's ``django.db.connection``, a proxy to this thread's
    default connection; anything else as it is. From Python 3.12, ``isinstance`` with a
    protocol reads attributes statically and no longer sees through the proxy."""
    if "django" not in sys.modules:
        return bind
    from django.utils.connection import ConnectionProxy

    if isinstance(bind, ConnectionProxy):
        from django.db import connections

        return connections[bind.alias]  # the proxy forwards attributes to the connection
    return bind


def own_transaction(bind: Engine | AsyncEngine | psycopg.Connection[Any]
                    | psycopg.AsyncConnection[Any] | DjangoConnection
                    ) -> Engine | AsyncEngine | OwnTransaction | AsyncOwnTransaction:
    """What commits a call at once: an engine, or a connection outside any transaction."""
    bind = unproxied(bind)
    if isinstance(bind, Engine | AsyncEngine):
        return bind
    if isinstance(bind, psycopg.AsyncConnection):
        return AsyncOwnTransaction(bind)
    if isinstance(bind, psycopg.Connection | DjangoConnection):
        return OwnTransaction(bind)
    raise ConfigurationError(
        f"send_in_transaction() commits on its own: pass an Engine, AsyncEngine, psycopg "
        f"connection or Django connection, not this {_kind(bind)}"
    )


@overload
def deciding(bind: SyncBind) -> SyncBind: ...


@overload
def deciding(bind: AsyncBind) -> AsyncBind: ...


def deciding(bind: SyncBind | AsyncBind) -> SyncBind | AsyncBind:
    """Where a decision (commit, rollback) runs: a psycopg connection in autocommit mode
    outside any transaction (SQLAlchemy's ``AUTOCOMMIT`` isolation level on psycopg too), or
    a Django connection outside ``atomic()``, commits it at once, as an engine does (the
    application's own writes there commit one by one too), and so does a SQLAlchemy
    ``AUTOCOMMIT`` connection on psycopg2 or asyncpg; anything else as given."""
    target = _under_autocommit(unproxied(bind))
    if isinstance(target, psycopg.Connection | psycopg.AsyncConnection):
        if target.autocommit and not _busy(target):  # an async one synced by deciding_async
            return (AsyncOwnTransaction(target) if isinstance(target, psycopg.AsyncConnection)
                    else OwnTransaction(target))
    elif isinstance(target, DjangoConnection) and not _busy(target):
        return OwnTransaction(target)
    elif isinstance(target, AsyncConnection) and autocommit_mode(target.sync_connection):
        return AsyncAutocommitting(target)
    elif isinstance(target, Connection) and autocommit_mode(target):
        return Autocommitting(target)
    return bind


async def deciding_async(bind: AsyncBind) -> AsyncBind:
    """:func:`deciding` for an async connection, whose pipeline is synced here first."""
    target = _under_autocommit(bind)
    if isinstance(target, psycopg.AsyncConnection):
        await _synced_async(target)
    return deciding(bind)


def _under_autocommit(bind: Any) -> Any:
    """The psycopg connection under a SQLAlchemy one in ``AUTOCOMMIT`` mode (where SQLAlchemy's
    transaction opens none in the database); anything else as given."""
    sync = bind.sync_connection if isinstance(bind, AsyncConnection) else bind
    if isinstance(sync, Connection) and autocommit_mode(sync):
        driver = sync.connection.driver_connection
        if isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
            return driver
    return bind


def autocommit_mode(connection: Connection | None) -> bool:
    """Whether a SQLAlchemy connection is in ``AUTOCOMMIT`` mode (each statement commits)."""
    return connection is not None and not connection.closed and _autocommit(connection)


def execute(bind: SyncBind, statement: TextClause, params: dict[str, Any],
            errors: contextlib.AbstractContextManager[object]) -> Rows:
    """Run ``statement`` in the caller's open transaction (an engine: in its own) inside
    ``errors``, which words its failures. A session's pending writes are flushed before it,
    outside ``errors``: their failures are the application's, and stay as they are."""
    target = bind() if isinstance(bind, scoped_session) else unproxied(bind)
    if isinstance(target, Session | Connection):
        if isinstance(target, Session):
            _require_one_engine(target)
        in_transaction = target.in_transaction()
        connection = (target.connection() if isinstance(target, Session) and in_transaction
                      else target)
        _require_sqlalchemy_transaction(in_transaction, connection)
        if isinstance(target, Session):
            # as Session.execute does: writes go in the order written, and a publish
            # from a flush hook (the session is flushing) does not flush again
            target._autoflush()
        driver = _psycopg_of(connection)
        with errors:
            if driver is not None and isinstance(connection, Connection):
                return _run_on_sqlalchemy_driver(connection, driver, statement, params)
            # the session's connection, not Session.execute, which SQLModel deprecates
            return list(connection.execute(statement, params))
    with errors:
        if isinstance(target, Engine):
            with target.begin() as conn:
                return list(conn.execute(statement, params))
        if isinstance(target, OwnTransaction):
            with _alone(target.connection) as alone:
                return _run_on_driver(alone, statement, params)
        if isinstance(target, Autocommitting):
            began = not target.connection.in_transaction()
            rows = list(target.connection.execute(statement, params))
            if began:  # SQLAlchemy's autobegun transaction, empty in the database
                target.connection.commit()
            return rows
        return _run_on_driver(_in_transaction(target), statement, params)


async def execute_async(bind: AsyncBind, statement: TextClause, params: dict[str, Any],
                        errors: contextlib.AbstractContextManager[object]) -> Rows:
    """The async twin of :func:`execute`: the same checks, awaited execution."""
    target = bind() if isinstance(bind, async_scoped_session) else bind
    if isinstance(target, AsyncSession | AsyncConnection):
        if isinstance(target, AsyncSession):
            _require_one_engine(target.sync_session)
        in_transaction = target.in_transaction()
        connection = (await target.connection() if isinstance(target, AsyncSession) and
                      in_transaction else target)
        _require_sqlalchemy_transaction(in_transaction, connection)
        if isinstance(target, AsyncSession) and not target.sync_session._is_clean():
            await target.run_sync(Session._autoflush)  # a round into SQLAlchemy's greenlet
        with errors:
            # the session's connection: SQLModel's AsyncSession.execute warns (use exec)
            return list(await connection.execute(statement, params))
    with errors:
        if isinstance(target, AsyncEngine):
            async with target.begin() as conn:
                return list(await conn.execute(statement, params))
        if isinstance(target, AsyncOwnTransaction):
            _require_idle(_busy(await _synced_async(target.connection)))
            async with target.connection.transaction():
                return await _run_on_async_psycopg(target.connection, statement, params)
        if isinstance(target, AsyncAutocommitting):
            began = not target.connection.in_transaction()
            rows = list(await target.connection.execute(statement, params))
            if began:
                await target.connection.commit()
            return rows
        _require_transaction(await _async_psycopg_in_transaction(target), "postgresql")
        return await _run_on_async_psycopg(target, statement, params)


def _require_one_engine(session: Session) -> None:
    """A Session that routes to several engines (``binds=``, Flask-SQLAlchemy's binds, a
    ``get_bind`` of its own, e.g. to read replicas) would write the message through its
    default engine: another connection, in a transaction of its own beside the caller's,
    committed or lost apart from the business rows. Refused."""
    engines = {id(bind) for bind in session.binds.values()}
    flask = getattr(session, "_db", None)  # Flask-SQLAlchemy's session routes by its binds
    if flask is not None:
        with contextlib.suppress(RuntimeError):  # no app context: its default engine only
            engines |= {id(bind) for bind in flask.engines.values()}
    if session.bind is not None:
        engines.add(id(session.bind))
    routed = flask is None and type(session).get_bind is not Session.get_bind
    if len(engines) > 1 or routed:
        raise ConfigurationError(
            f"this {type(session).__name__} routes to several engines, and the message would "
            "go through another connection than your writes: pass the connection they go "
            "through, session.connection(bind_arguments={'mapper': YourModel}), after "
            "session.flush() (that connection does not flush the session)")


def _require_sqlalchemy_transaction(in_transaction: bool, connection: Session | Connection
                                    | AsyncSession | AsyncConnection) -> None:
    """``connection`` is the session itself when it has no transaction (nothing to ask)."""
    if isinstance(connection, AsyncConnection):
        connection = connection.sync_connection  # type: ignore[assignment]
    if not isinstance(connection, Connection):  # the publish path does no more than this
        _require_transaction(False, _dialect_of(connection))
        return
    _require_transaction(in_transaction and not _autocommit(connection), connection.dialect.name)


def _dialect_of(session: Session | AsyncSession | AsyncConnection) -> str:
    """The database a session without a transaction would talk to (SQLite is refused as
    such, not as a session without a transaction)."""
    if isinstance(session, AsyncConnection):
        return session.dialect.name
    sync = session.sync_session if isinstance(session, AsyncSession) else session
    try:
        return sync.get_bind().dialect.name
    except UnboundExecutionError:  # no engine at all: the transaction is what is missing
        return "postgresql"


def _psycopg_of(connection: Session | Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection under a SQLAlchemy one: the publish statement goes to it
    directly (prepared by psycopg after a few runs), a third cheaper than through Core."""
    if not isinstance(connection, Connection):
        return None
    driver = connection.connection.driver_connection
    return driver if isinstance(driver, psycopg.Connection) else None


def _autocommit(connection: Connection) -> bool:
    """SQLAlchemy's own answer for the driver in use, without a round trip."""
    dbapi_connection = connection.connection.dbapi_connection
    try:
        return connection.dialect.detect_autocommit_setting(dbapi_connection)  # type: ignore[arg-type]
    except (AttributeError, NotImplementedError):  # SQLAlchemy 2.0: the DBAPI attribute
        return bool(getattr(dbapi_connection, "autocommit", False))


#: What an autocommit connection's status reads inside a transaction block.
IN_BLOCK = (TransactionStatus.INTRANS, TransactionStatus.INERROR)
#: What a closed or lost connection's status reads: in no transaction, nor out of one. Its
#: statement is let through, so that psycopg raises its own OperationalError.
LOST = TransactionStatus.UNKNOWN


def _psycopg_in_transaction(conn: psycopg.Connection[Any]) -> bool:
    """Outside autocommit psycopg opens a transaction by itself; inside, only a block does."""
    return not conn.autocommit or _synced(conn).info.transaction_status in (*IN_BLOCK, LOST)


async def _async_psycopg_in_transaction(conn: psycopg.AsyncConnection[Any]) -> bool:
    """The async twin of :func:`_psycopg_in_transaction`."""
    if not conn.autocommit:
        return True
    return (await _synced_async(conn)).info.transaction_status in (*IN_BLOCK, LOST)


def _synced(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """In pipeline mode the status reads ACTIVE while statements are queued, in a block or
    not: leaving a nested pipeline syncs it first, and then the status tells."""
    if conn.info.pipeline_status != PipelineStatus.OFF:
        with conn.pipeline():
            pass
    return conn


async def _synced_async(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    if conn.info.pipeline_status != PipelineStatus.OFF:
        async with conn.pipeline():
            pass
    return conn


def _in_transaction(bind: psycopg.Connection[Any] | DjangoConnection
                    ) -> psycopg.Connection[Any] | DjangoConnection:
    if isinstance(bind, psycopg.Connection):
        _require_transaction(_psycopg_in_transaction(bind), "postgresql")
    elif isinstance(bind, DjangoConnection):
        _require_transaction(bind.in_atomic_block or not bind.get_autocommit(), bind.vendor)
    else:
        raise ConfigurationError(
            f"the outbox cannot use this {_kind(bind)}: pass a SQLAlchemy session or connection "
            "(psycopg2 and asyncpg are supported under SQLAlchemy: postgresql+psycopg2://, "
            "postgresql+asyncpg://), a psycopg 3 connection or a Django connection"
        )
    return bind


def _kind(bind: object) -> str:
    """A refused object's class with its module (asyncpg's, SQLAlchemy's and sqlite3's are
    all named ``Connection``)."""
    kind = type(bind)
    return (kind.__qualname__ if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}")


@contextlib.contextmanager
def _alone(bind: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | DjangoConnection
           ) -> Iterator[psycopg.Connection[Any] | DjangoConnection]:
    _require_idle(_busy(bind))
    if isinstance(bind, psycopg.Connection):
        with bind.transaction():
            yield bind
    elif isinstance(bind, DjangoConnection):
        from django.db import transaction

        with transaction.atomic(using=bind.alias):
            yield bind
    else:
        raise AssertionError(f"{type(bind).__name__} is async")


def _run_on_driver(bind: psycopg.Connection[Any] | DjangoConnection, statement: TextClause,
                   params: dict[str, Any]) -> Rows:
    """psycopg's ``%(name)s`` style (a connection whose cursors take ``$1`` only, RawCursor,
    gets a plain cursor; its other factories, ClientCursor for a pooler, are kept); Django's
    cursor passes it through to psycopg."""
    if isinstance(bind, psycopg.Connection):
        raw = issubclass(bind.cursor_factory, RawCursorMixin)
        with (psycopg.Cursor(bind, row_factory=namedtuple_row) if raw
              else bind.cursor(row_factory=namedtuple_row)) as cursor:
            cursor.execute(store.driver_sql(statement), params)
            return cursor.fetchall()
    with bind.cursor() as cursor:
        cursor.execute(store.driver_sql(statement), params)
        row = namedtuple("row", [column[0] for column in cursor.description])  # type: ignore[misc]
        return [row._make(values) for values in cursor.fetchall()]


def _run_on_sqlalchemy_driver(connection: Connection, driver: psycopg.Connection[Any],
                              statement: TextClause, params: dict[str, Any]) -> Rows:
    """On the psycopg connection under ``connection``, failing as SQLAlchemy's own execution
    does: the error wrapped in its DBAPIError (what retry code written for SQLAlchemy
    catches), a lost connection invalidated, its ``handle_error`` hooks run."""
    try:
        return _run_on_driver(driver, statement, params)
    except psycopg.Error as exc:
        connection._handle_dbapi_exception(exc, store.driver_sql(statement), params, None, None)


async def _run_on_async_psycopg(bind: psycopg.AsyncConnection[Any], statement: TextClause,
                                params: dict[str, Any]) -> Rows:
    raw = issubclass(bind.cursor_factory, RawCursorMixin)
    async with (psycopg.AsyncCursor(bind, row_factory=namedtuple_row) if raw
                else bind.cursor(row_factory=namedtuple_row)) as cursor:
        await cursor.execute(store.driver_sql(statement), params)
        return await cursor.fetchall()


def _require_transaction(in_transaction: bool, dialect: str) -> None:
    """Refuse to publish where the row would not share the business transaction's fate."""
    if dialect != "postgresql":
        raise ConfigurationError(f"the outbox needs PostgreSQL, but this session uses {dialect}")
    if not in_transaction:
        raise NotInTransaction(
            "publish(), prepare(), commit() and rollback() need an open transaction, so "
            "they commit or roll back with your data: call them inside `with session.begin():` "
            "(or `async with ...`, psycopg's `conn.transaction()`, Django's "
            "`transaction.atomic()`), not in autocommit mode; a commit() or rollback() "
            "may be given an Engine, or a psycopg, Django or SQLAlchemy AUTOCOMMIT "
            "connection outside any transaction, instead, which commits it at once"
        )


def _busy(bind: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | DjangoConnection
          ) -> bool:
    """Whether a transaction is open on the connection (psycopg's, outside autocommit, opens
    at the first statement; Django's, in ``atomic()`` or with autocommit off). A lost one
    has none, and its statement then raises psycopg's error. A pipeline is synced first (an
    async one by the caller: unsynced, statements queued read as a transaction)."""
    if isinstance(bind, DjangoConnection):
        return bind.in_atomic_block or not bind.get_autocommit()
    if isinstance(bind, psycopg.Connection):
        _synced(bind)
    return bind.info.transaction_status not in (TransactionStatus.IDLE, LOST)


def _require_idle(in_transaction: bool) -> None:
    if in_transaction:
        raise ConfigurationError(
            "send_in_transaction() commits its prepare row before the local transaction "
            "runs: call it on a connection outside any transaction (a Django view under "
            "ATOMIC_REQUESTS: decorate it with @transaction.non_atomic_requests)"
        )


def require_idle_after(owner: SyncBind | AsyncBind) -> None:
    """Before the local transaction's answer is recorded on the connection
    ``send_in_transaction()`` was given: a transaction it left open there would be refused
    as if the prepare row had been, with the wrong reason."""
    if isinstance(owner, OwnTransaction | AsyncOwnTransaction) and _busy(owner.connection):
        raise ConfigurationError(
            "the local transaction left a transaction open on the connection "
            "send_in_transaction() was given (psycopg opens one at the first statement "
            "outside autocommit): commit or roll it back before returning, or use another "
            "connection; its answer was not recorded")


async def require_idle_after_async(owner: AsyncBind) -> None:
    """:func:`require_idle_after` for an async connection, whose pipeline is synced first."""
    if isinstance(owner, AsyncOwnTransaction):
        await _synced_async(owner.connection)
    require_idle_after(owner)
