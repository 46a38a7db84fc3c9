"""Every PostgreSQL driver SQLAlchemy offers behaves the same: psycopg 3 (sync and async),
psycopg2 and asyncpg, through sessions, scoped sessions and engines."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    scoped_session,
    sessionmaker,
)
from sqlalchemy.pool import AsyncAdaptedQueuePool, NullPool

from outbox import Message, NotAwaited, NotInTransaction, Outbox, Resolution, SchemaNotMigrated
from outbox.dev.topics import read_topic
from outbox.exceptions import ConfigurationError, sqlstate
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import count_status, wait_delivered

DRIVERS = ["psycopg", "psycopg2", "psycopg_async", "asyncpg"]


class Stack:
    """One driver, driven the same way whether it is sync or async."""

    def __init__(self, driver: str, url: str) -> None:
        self.driver = driver
        self.is_async = driver in ("psycopg_async", "asyncpg")
        self.url = make_url(url).set(drivername=f"postgresql+{driver}")

    def run(self, scenario: Callable[[Any], Any], **engine_options: Any) -> Any:
        """Run ``scenario(engine)`` (awaited for async drivers) on a fresh engine."""
        if not self.is_async:
            engine = create_engine(self.url, poolclass=NullPool, **engine_options)
            try:
                return scenario(engine)
            finally:
                engine.dispose()

        async def main() -> Any:
            engine = create_async_engine(self.url, **{"poolclass": NullPool, **engine_options})
            try:
                return await scenario(engine)
            finally:
                await engine.dispose()

        return asyncio.run(main())


@pytest.fixture(params=DRIVERS)
def stack(request: pytest.FixtureRequest, settings: Settings) -> Stack:
    return Stack(request.param, settings.database_url)


def publish_in_session(stack: Stack, outbox: Outbox, topic: str, n: int, *, commit: bool
                       ) -> int:
    def sync(engine: Engine) -> int:
        with Session(engine) as session:
            session.begin()
            message_id = outbox.publish(session, topic, {"n": n}, key="k")
            session.commit() if commit else session.rollback()
            return message_id

    async def async_(engine: AsyncEngine) -> int:
        async with AsyncSession(engine) as session:
            await session.begin()
            message_id = await outbox.publish(session, topic, {"n": n}, key="k")
            await (session.commit() if commit else session.rollback())
            return message_id

    return int(stack.run(async_ if stack.is_async else sync))


def test_commit_is_delivered_and_rollback_is_not(
    stack: Stack, outbox: Outbox, topic: str, engine: Engine, schema: str, settings: Settings,
    relay: Relay,
) -> None:
    committed = publish_in_session(stack, outbox, topic, 1, commit=True)
    rolled_back = publish_in_session(stack, outbox, topic, 2, commit=False)
    wait_delivered(engine, schema, 1)
    delivered = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)]
    assert delivered == [committed]
    assert rolled_back not in delivered


def test_an_autocommit_engine_is_refused(stack: Stack, outbox: Outbox, engine: Engine,
                                         schema: str) -> None:
    def sync(autocommit: Engine) -> None:
        with Session(autocommit) as session, session.begin():
            outbox.publish(session, "orders", {"n": 1})

    async def async_(autocommit: AsyncEngine) -> None:
        async with AsyncSession(autocommit) as session, session.begin():
            await outbox.publish(session, "orders", {"n": 1})

    with pytest.raises(NotInTransaction, match="autocommit"):
        stack.run(async_ if stack.is_async else sync, isolation_level="AUTOCOMMIT")
    assert count_status(engine, schema, "PENDING") == 0


def test_scoped_sessions_are_accepted(stack: Stack, outbox: Outbox, engine: Engine,
                                      schema: str) -> None:
    """Flask-SQLAlchemy's ``db.session`` is a ``scoped_session``."""

    def sync(bound: Engine) -> int:
        scoped = scoped_session(sessionmaker(bound))
        try:
            with scoped.begin():
                return outbox.publish(scoped, "orders", {"n": 1})
        finally:
            scoped.remove()

    async def async_(bound: AsyncEngine) -> int:
        scoped = async_scoped_session(async_sessionmaker(bound), scopefunc=asyncio.current_task)
        try:
            async with scoped.begin():
                return await outbox.publish(scoped, "orders", {"n": 1})
        finally:
            await scoped.remove()

    message_id = stack.run(async_ if stack.is_async else sync)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT status FROM {schema}.message_state WHERE id = :id"),
                            {"id": message_id}).scalar_one() == "PENDING"


def test_two_phase_prepare_commit_rollback_and_send_in_transaction(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    def sync(bound: Engine) -> tuple[int, int, Any]:
        with Session(bound) as session, session.begin():
            first = outbox.prepare(session, "orders", {"n": 1})
            second = outbox.prepare(session, "orders", {"n": 2})
        outbox.commit(bound, first)
        with Session(bound) as session, session.begin():
            outbox.rollback(session, second)
        return first, second, outbox.send_in_transaction(bound, "orders", {"n": 3}, commit)

    async def async_(bound: AsyncEngine) -> tuple[int, int, Any]:
        async with AsyncSession(bound) as session, session.begin():
            first = await outbox.prepare(session, "orders", {"n": 1})
            second = await outbox.prepare(session, "orders", {"n": 2})
        await outbox.commit(bound, first)
        async with AsyncSession(bound) as session, session.begin():
            await outbox.rollback(session, second)
        sent = await outbox.send_in_transaction(bound, "orders", {"n": 3}, commit)
        return first, second, sent

    def commit(message: Message) -> str:
        return "COMMIT"

    first, second, sent = stack.run(async_ if stack.is_async else sync)
    assert sent.resolution is Resolution.COMMIT
    with engine.connect() as conn:
        rows = dict(conn.execute(text(f"SELECT id, resolution FROM {schema}.message_state")).all())
    assert rows == {first: "COMMIT", second: "ROLLBACK", sent.message_id: "COMMIT"}


def test_an_unmigrated_schema_says_which_command_to_run(stack: Stack, settings: Settings
                                                        ) -> None:
    outbox = Outbox(settings=settings, schema=f"missing_{uuid.uuid4().hex[:8]}")

    def sync(bound: Engine) -> None:
        with Session(bound) as session, session.begin():
            outbox.publish(session, "orders", {"n": 1})

    async def async_(bound: AsyncEngine) -> None:
        async with AsyncSession(bound) as session, session.begin():
            await outbox.publish(session, "orders", {"n": 1})

    with pytest.raises(SchemaNotMigrated, match=r"outbox --schema missing_\w+ db upgrade"):
        stack.run(async_ if stack.is_async else sync)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "driver_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str]


def test_publish_flushes_the_session_s_changes_first_with_every_driver(
    stack: Stack, outbox: Outbox, engine: Engine
) -> None:
    """Session.execute flushes what the session holds first; on psycopg 3 the publish went to
    the driver without it, so the business rows were written at commit, after the key's lock:
    code that locks rows then keys, as the docs advise, deadlocked with itself."""
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        conn.execute(text("TRUNCATE driver_orders"))
        conn.execute(text("INSERT INTO driver_orders VALUES (1, 'new')"))
    read = "SELECT state FROM driver_orders WHERE id = 1"

    def sync(engine: Engine) -> str:
        with Session(engine) as session, session.begin():
            order = session.get(Order, 1)
            assert order is not None
            order.state = "paid"
            outbox.publish(session, "orders", {"n": 1}, key="c")
            return str(session.connection().exec_driver_sql(read).scalar_one())

    async def async_(engine: AsyncEngine) -> str:
        async with AsyncSession(engine) as session, session.begin():
            order = await session.get(Order, 1)
            assert order is not None
            order.state = "paid"
            await outbox.publish(session, "orders", {"n": 1}, key="c")
            conn = await session.connection()
            return str((await conn.exec_driver_sql(read)).scalar_one())

    try:
        assert stack.run(async_ if stack.is_async else sync) == "paid"
    finally:
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)


class PublishingSession(Session):
    """A session that publishes an event for each new order as it is flushed."""


def test_publish_from_a_flush_event_works_with_every_driver(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """Domain events published from a flush hook: Session.execute does not flush again while
    the session is flushing, but on psycopg 3 the publish flushed anyway and SQLAlchemy
    refused it ("Session is already flushing"), where every other driver published."""
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        conn.execute(text("TRUNCATE driver_orders"))
    published: list[int] = []

    def on_flush(session: Session, context: Any) -> None:
        for order in session.new:
            published.append(outbox.publish(session, "orders", {"id": order.id}))

    def sync(engine: Engine) -> None:
        with PublishingSession(engine) as session, session.begin():
            session.add(Order(id=1, state="new"))

    async def async_(engine: AsyncEngine) -> None:
        async with AsyncSession(engine, sync_session_class=PublishingSession) as session, \
                session.begin():
            session.add(Order(id=1, state="new"))

    event.listen(PublishingSession, "after_flush", on_flush)
    try:
        stack.run(async_ if stack.is_async else sync)
    finally:
        event.remove(PublishingSession, "after_flush", on_flush)
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)
    with engine.connect() as conn:
        statuses = conn.execute(text(f"SELECT status FROM {schema}.message_state "
                                     "WHERE id = ANY(:ids)"), {"ids": published}).scalars()
        assert list(statuses) == ["PENDING"]


def test_a_bare_psycopg2_or_asyncpg_connection_is_told_to_go_through_sqlalchemy(
    outbox: Outbox, settings: Settings
) -> None:
    """They are supported under SQLAlchemy only; refused bare, the error named the class
    alone ("cannot publish through a Connection: pass a SQLAlchemy session or connection"),
    which for asyncpg's reads as if a connection were what was missing."""
    import asyncpg
    import psycopg2

    url = make_url(settings.database_url).set(drivername="postgresql")
    conninfo = url.render_as_string(hide_password=False)
    with contextlib.closing(psycopg2.connect(conninfo)) as bare:
        for call in (lambda: outbox.publish(bare, "orders", {"n": 1}),  # type: ignore[call-overload]
                     lambda: outbox.commit(bare, 1)):  # type: ignore[call-overload]
            with pytest.raises(ConfigurationError,
                               match=r"psycopg2\.extensions\.connection.*postgresql\+psycopg2"):
                call()

    async def asyncpg_refused() -> None:
        bare = await asyncpg.connect(conninfo)
        try:
            async with bare.transaction():
                with pytest.raises(ConfigurationError,
                                   match=r"asyncpg\.connection\.Connection.*postgresql\+asyncpg"):
                    outbox.publish(bare, "orders", {"n": 1})  # type: ignore[call-overload]
            with pytest.raises(ConfigurationError, match=r"asyncpg\.connection\.Connection"):
                outbox.send_in_transaction(bare, "orders", {"n": 1},  # type: ignore[call-overload]
                                           lambda message: None)
        finally:
            await bare.close()

    asyncio.run(asyncpg_refused())


def test_a_decision_on_an_autocommit_connection_commits_at_once_with_every_driver(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """SQLAlchemy's AUTOCOMMIT opens no transaction in the database: on psycopg 3 a decision
    there commits at once, as through an engine, but on psycopg2 and asyncpg it was refused
    (NotInTransaction). Every driver now decides at once and leaves the connection as it
    was (no SQLAlchemy transaction begun); a publish there is still refused."""
    with engine.begin() as conn:
        first, second = (outbox.prepare(conn, "orders", {"n": n}) for n in range(2))
    read = text(f"SELECT id, resolution FROM {schema}.message_state")

    def sync(autocommit: Engine) -> tuple[bool, dict[int, str]]:
        with autocommit.connect() as conn:
            outbox.commit(conn, first)
            outbox.rollback(conn, second)
            with pytest.raises(NotInTransaction, match="autocommit"):
                outbox.publish(conn, "orders", {"n": 3})
            with engine.connect() as other:
                return conn.in_transaction(), dict(other.execute(read).all())

    async def async_(autocommit: AsyncEngine) -> tuple[bool, dict[int, str]]:
        async with autocommit.connect() as conn:
            await outbox.commit(conn, first)
            await outbox.rollback(conn, second)
            with pytest.raises(NotInTransaction, match="autocommit"):
                await outbox.publish(conn, "orders", {"n": 3})
            with engine.connect() as other:
                return conn.in_transaction(), dict(other.execute(read).all())

    in_transaction, decided = stack.run(async_ if stack.is_async else sync,
                                        isolation_level="AUTOCOMMIT")
    assert decided == {first: "COMMIT", second: "ROLLBACK"}
    assert not in_transaction


class Unmigrated(Base):
    __tablename__ = "driver_orders_never_created"
    id: Mapped[int] = mapped_column(primary_key=True)


def test_a_missing_table_of_the_application_is_not_called_an_unmigrated_outbox(
    stack: Stack, outbox: Outbox
) -> None:
    """The session's own writes are flushed before the publish; when their table is missing
    (the application's migration was not run), that error was turned into SchemaNotMigrated,
    "outbox schema 'outbox' has no outbox tables: run `outbox db upgrade`", which the outbox's
    migration cannot fix. It now comes as SQLAlchemy raises it."""

    def sync(engine: Engine) -> None:
        with Session(engine) as session, session.begin():
            session.add(Unmigrated(id=1))
            outbox.publish(session, "orders", {"n": 1})

    async def async_(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin():
            session.add(Unmigrated(id=1))
            await outbox.publish(session, "orders", {"n": 1})

    with pytest.raises(ProgrammingError, match="driver_orders_never_created"):
        stack.run(async_ if stack.is_async else sync)


@pytest.mark.parametrize("stack", ["psycopg_async", "asyncpg"], indirect=True)
def test_a_forgotten_await_refuses_the_commit_and_the_business_rows_roll_back(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """``publish`` on an async session returns a coroutine: without ``await`` it wrote nothing,
    the business rows committed without their message, and only a RuntimeWarning at garbage
    collection said so. The call now records itself at once and the commit is refused, so the
    business rows roll back with the message that was never written (and a connection's
    next transaction does not commit them); the same for prepare and a decision, through a
    session or a connection. Awaited later, before the commit, it is fine."""
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        conn.execute(text("TRUNCATE driver_orders"))
    with engine.begin() as conn:
        prepared = outbox.prepare(conn, "orders", {"n": 0})
    insert = text("INSERT INTO driver_orders VALUES (:id, 'new')")

    async def scenario(bound: AsyncEngine) -> None:
        calls: list[Callable[[Any], Any]] = [
            lambda s: outbox.publish(s, "orders", {"n": 1}),
            lambda s: outbox.prepare(s, "orders", {"n": 2}),
            lambda s: outbox.commit(s, prepared),
        ]
        for n, call in enumerate(calls, start=1):
            with pytest.warns(RuntimeWarning, match="never awaited"):
                async with AsyncSession(bound) as session:
                    with pytest.raises(NotAwaited, match="never awaited"):
                        async with session.begin():
                            await session.execute(insert, {"id": n})
                            call(session)  # forgotten await
                async with bound.connect() as conn:
                    with pytest.raises(NotAwaited, match="never awaited"):
                        async with conn.begin():
                            await conn.execute(insert, {"id": n})
                            call(conn)  # forgotten await
                    async with conn.begin():  # the refused rows are not in the next one
                        await conn.execute(insert, {"id": 10 + n})
                gc.collect()
        async with AsyncSession(bound) as session, session.begin():
            await session.execute(insert, {"id": 9})
            pending = outbox.publish(session, "orders", {"n": 9})
            await pending

    try:
        stack.run(scenario)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM driver_orders ORDER BY id")
                                ).scalars().all() == [9, 11, 12, 13]
            assert dict(conn.execute(text(
                f"SELECT resolution, count(*) FROM {schema}.message_state GROUP BY 1")).all()
            ) == {"UNKNOWN": 1, "COMMIT": 1}
    finally:
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)


@pytest.mark.parametrize("stack", ["psycopg_async", "asyncpg"], indirect=True)
def test_a_publish_cancelled_before_it_ran_refuses_only_its_own_transaction(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """A publish cancelled before its first step (``wait_for`` timing out, a request task
    cancelled as its client goes away) wrote nothing. Made outside any transaction, it stayed
    recorded as never awaited, and the next commit of that session or connection, a later
    unit of work that awaited all of its own calls, was refused. It is now forgotten; made in
    a transaction, it still refuses that transaction's commit, saying it was cancelled."""

    async def cancelled(call: Any) -> None:
        task = asyncio.ensure_future(call)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def scenario(bound: AsyncEngine) -> list[str]:
        refusals = []
        async with AsyncSession(bound) as session:
            await cancelled(outbox.publish(session, "orders", {"n": 1}))
            async with session.begin():
                await outbox.publish(session, "orders", {"n": 2})
            with pytest.raises(NotAwaited) as refused:
                async with session.begin():
                    await cancelled(outbox.publish(session, "orders", {"n": 3}))
            refusals.append(str(refused.value))
        async with bound.connect() as conn:
            await cancelled(outbox.publish(conn, "orders", {"n": 4}))
            await conn.rollback()
            async with conn.begin():
                await outbox.publish(conn, "orders", {"n": 5})
        return refusals

    refusals = stack.run(scenario)
    assert len(refusals) == 1 and "cancelled before it completed" in refusals[0], refusals
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.message_state")
                            ).scalar_one() == 2


@pytest.mark.parametrize("stack", ["psycopg_async", "asyncpg"], indirect=True)
def test_a_call_cancelled_in_a_savepoint_rolled_back_refuses_no_commit(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """A step that fails in a savepoint (``begin_nested()``) is rolled back with it and the
    transaction goes on: that is how a transaction survives one failed step. A publish
    cancelled before it ran there stayed recorded, and the outer commit was refused though
    nothing of the savepoint was left to commit; so was a forgotten one."""

    async def cancelled(call: Any) -> None:
        task = asyncio.ensure_future(call)
        task.cancel()
        await task

    async def scenario(bound: AsyncEngine) -> None:
        async with AsyncSession(bound) as session, session.begin():
            await outbox.publish(session, "orders", {"n": 1})
            with pytest.raises(asyncio.CancelledError):
                async with session.begin_nested():
                    await cancelled(outbox.publish(session, "orders", {"n": 2}))
        async with bound.connect() as conn, conn.begin():
            await outbox.publish(conn, "orders", {"n": 3})
            with pytest.raises(asyncio.CancelledError):
                async with conn.begin_nested():
                    await cancelled(outbox.publish(conn, "orders", {"n": 4}))

    stack.run(scenario)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.message_state")
                            ).scalar_one() == 2


@pytest.mark.parametrize("stack", ["psycopg_async", "asyncpg"], indirect=True)
def test_a_publish_cancelled_before_its_statement_ran_refuses_the_commit(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """``asyncio.timeout()`` around a publish that waits for a pooled connection (or for the
    session's flush) cancels it before its statement is sent: nothing of it is written and
    the connection is not invalidated. Code that went on after the timeout then committed the
    business rows without their message. The commit is now refused (``NotAwaited``, "was
    cancelled before it completed"); rolled back, the session is usable again."""
    insert = text("INSERT INTO driver_orders VALUES (1, 'new')")
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        conn.execute(text("TRUNCATE driver_orders"))

    async def scenario(bound: AsyncEngine) -> str:
        async with AsyncSession(bound) as session:
            await session.begin()
            async with bound.connect() as only:  # the pool's one connection
                await only.execute(text("SELECT 1"))
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await outbox.publish(session, "orders", {"n": 1})
            await session.execute(insert)
            with pytest.raises(NotAwaited) as refused:
                await session.commit()
            await session.rollback()
            async with session.begin():
                await session.execute(insert)
                await outbox.publish(session, "orders", {"n": 2})
        return str(refused.value)

    try:
        refusal = stack.run(scenario, poolclass=AsyncAdaptedQueuePool, pool_size=1,
                            max_overflow=0)
        assert "cancelled before it completed" in refusal, refusal
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM driver_orders")).scalar_one() == 1
            assert conn.execute(text(f"SELECT count(*) FROM {schema}.message_state")
                                ).scalar_one() == 1
    finally:
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)


@pytest.mark.parametrize("stack", ["psycopg_async"], indirect=True)
def test_a_decision_cancelled_on_an_autocommit_connection_refuses_no_later_commit(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """On an ``AUTOCOMMIT`` connection a decision commits on its own (on psycopg 3, on the
    psycopg connection under it, which SQLAlchemy does not invalidate when it is cancelled):
    there is no transaction a cancelled one could leave without its message, so it is not
    kept to refuse the connection's commits. Decided again, it is recorded."""
    with engine.begin() as conn:
        prepared = outbox.prepare(conn, "orders", {"n": 1}, key="k")

    async def scenario(bound: AsyncEngine) -> None:
        with engine.connect() as holder:
            holder.begin()
            outbox.commit(holder, prepared)  # holds the message's row
            async with bound.connect() as conn:
                await conn.execute(text("SELECT 1"))
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await outbox.commit(conn, prepared)
                holder.rollback()
                await outbox.commit(conn, prepared)
                await conn.commit()

    stack.run(scenario, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT resolution FROM {schema}.message_state")
                            ).scalar_one() == "COMMIT"


def test_a_publish_on_a_lost_connection_or_past_a_lock_timeout_raises_what_sqlalchemy_does(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """Through a sync session on psycopg 3 the statement goes to psycopg directly, and its
    errors came out bare: a backend ended by pg_terminate_backend raised
    psycopg.errors.AdminShutdown, not the sqlalchemy.exc.OperationalError that retry code
    written for SQLAlchemy waits for, SQLAlchemy did not invalidate the connection (nor run
    its handle_error hooks), and a lock_timeout on a key's lock raised a bare
    LockNotAvailable. Now every driver raises SQLAlchemy's DBAPIError with the driver's error
    as ``orig``, a lost connection flagged invalidated; nothing of either is written."""
    kill = text("SELECT pg_terminate_backend(:pid)")
    wait = text("SET LOCAL lock_timeout = '100ms'")

    def sync(bound: Engine) -> list[DBAPIError]:
        failures = []
        with Session(bound) as session:
            session.begin()
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with engine.begin() as admin:
                admin.execute(kill, {"pid": pid})
            with pytest.raises(DBAPIError) as lost:
                outbox.publish(session, "orders", {"n": 1}, key="k")
            failures.append(lost.value)
        with engine.connect() as holder, Session(bound) as session:
            holder.begin()
            outbox.publish(holder, "orders", {"n": 2}, key="held")
            session.begin()
            session.execute(wait)
            with pytest.raises(DBAPIError) as waited:
                outbox.publish(session, "orders", {"n": 3}, key="held")
            failures.append(waited.value)
            session.rollback()
            holder.rollback()
        return failures

    async def async_(bound: AsyncEngine) -> list[DBAPIError]:
        failures = []
        async with AsyncSession(bound) as session:
            await session.begin()
            pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            with engine.begin() as admin:
                admin.execute(kill, {"pid": pid})
            with pytest.raises(DBAPIError) as lost:
                await outbox.publish(session, "orders", {"n": 1}, key="k")
            failures.append(lost.value)
        with engine.connect() as holder:
            holder.begin()
            outbox.publish(holder, "orders", {"n": 2}, key="held")
            async with AsyncSession(bound) as session:
                await session.begin()
                await session.execute(wait)
                with pytest.raises(DBAPIError) as waited:
                    await outbox.publish(session, "orders", {"n": 3}, key="held")
                failures.append(waited.value)
                await session.rollback()
            holder.rollback()
        return failures

    lost, waited = stack.run(async_ if stack.is_async else sync)
    assert lost.connection_invalidated, repr(lost)
    assert sqlstate(waited) == "55P03" and not waited.connection_invalidated, repr(waited)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.message_state")
                            ).scalar_one() == 0


@pytest.fixture
def ungranted(engine: Engine, schema: str, roles: list[str]) -> Iterator[str]:
    """A login role that was not granted ``<schema>_app``."""
    login = f"{schema}_nobody"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw'"))
    yield login
    with engine.begin() as conn:
        conn.execute(text(f"DROP OWNED BY {login}"))
        conn.execute(text(f"DROP ROLE {login}"))


def test_a_login_without_the_app_role_is_told_which_role_to_grant_with_every_driver(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str, ungranted: str
) -> None:
    """publish, prepare and the decisions raised the driver's own error ("permission denied
    for schema t_..."), with no word of the role the outbox made for them. They now raise
    ConfigurationError naming it, with the driver's error as its cause."""
    with engine.begin() as conn:
        prepared = outbox.prepare(conn, "orders", {"n": 0})
    stack.url = stack.url.set(username=ungranted, password="pw")
    calls: list[Callable[[Any], Any]] = [
        lambda s: outbox.publish(s, "orders", {"n": 1}),
        lambda s: outbox.prepare(s, "orders", {"n": 2}),
        lambda s: outbox.commit(s, prepared),
    ]

    def sync(bound: Engine) -> list[BaseException]:
        failures = []
        for call in calls:
            with Session(bound) as session, session.begin(), \
                    pytest.raises(ConfigurationError) as refused:
                call(session)
            failures.append(refused.value)
        return failures

    async def async_(bound: AsyncEngine) -> list[BaseException]:
        failures = []
        for call in calls:
            async with AsyncSession(bound) as session, session.begin():
                with pytest.raises(ConfigurationError) as refused:
                    await call(session)
            failures.append(refused.value)
        return failures

    for failure in stack.run(async_ if stack.is_async else sync):
        assert f"grant it the role {schema}_app" in str(failure)
        assert "permission denied" in str(failure) and "\n" not in str(failure)
        assert sqlstate(failure.__cause__) == "42501"  # type: ignore[arg-type]


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_sqlmodel_sessions_publish_and_decide_without_a_warning_with_every_driver(
    stack: Stack, outbox: Outbox, engine: Engine, schema: str
) -> None:
    """SQLModel's sessions are SQLAlchemy's, but its AsyncSession deprecates ``execute`` (use
    ``exec``): every async publish went through it and printed SQLModel's advice to the
    application's log, or raised where warnings are errors (pytest's ``-W error``)."""
    import sqlmodel
    from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelAsyncSession

    def sync(bound: Engine) -> tuple[int, int]:
        with sqlmodel.Session(bound) as session, session.begin():
            published = outbox.publish(session, "orders", {"n": 1})
            prepared = outbox.prepare(session, "orders", {"n": 2})
        with sqlmodel.Session(bound) as session, session.begin():
            outbox.commit(session, prepared)
        return published, prepared

    async def async_(bound: AsyncEngine) -> tuple[int, int]:
        async with SQLModelAsyncSession(bound) as session, session.begin():
            published = await outbox.publish(session, "orders", {"n": 1})
            prepared = await outbox.prepare(session, "orders", {"n": 2})
        async with SQLModelAsyncSession(bound) as session, session.begin():
            await outbox.commit(session, prepared)
        return published, prepared

    published, prepared = stack.run(async_ if stack.is_async else sync)
    with engine.connect() as conn:
        assert dict(conn.execute(text(f"SELECT id, resolution FROM {schema}.message_state")
                                 ).all()) == {published: "COMMIT", prepared: "COMMIT"}
