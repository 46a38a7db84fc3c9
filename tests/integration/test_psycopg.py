"""Services without an ORM publish through a plain psycopg 3 connection, sync or async."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import (
    ConfigurationError,
    Message,
    NotInTransaction,
    Outbox,
    Resolution,
    SchemaNotMigrated,
)
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import count_status, wait_delivered


def resolutions(engine: Engine, schema: str) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text(f"SELECT id, resolution FROM {schema}.message_state")).all())


def commit(message: Message) -> str:
    return "COMMIT"


def test_sync_connection_commit_is_delivered_and_rollback_is_not(
    outbox: Outbox, topic: str, engine: Engine, schema: str, settings: Settings, relay: Relay
) -> None:
    with psycopg.connect(settings.database_url) as conn:          # not autocommit
        committed = outbox.publish(conn, topic, {"n": 1}, key="k")
        conn.commit()
        rolled_back = outbox.publish(conn, topic, {"n": 2}, key="k")
        conn.rollback()
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        with conn.transaction():
            committed_in_block = outbox.publish(conn, topic, {"n": 3}, key="k")
        with pytest.raises(NotInTransaction):
            outbox.publish(conn, topic, {"n": 4}, key="k")
    wait_delivered(engine, schema, 2)
    delivered = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)]
    assert delivered == [committed, committed_in_block]
    assert rolled_back not in delivered


def test_sync_connection_two_phase(outbox: Outbox, engine: Engine, schema: str,
                                   settings: Settings) -> None:
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        with conn.transaction():
            first = outbox.prepare(conn, "orders", {"n": 1})
            second = outbox.prepare(conn, "orders", {"n": 2})
        with conn.transaction():
            outbox.commit(conn, first)
            outbox.rollback(conn, second)
        sent = outbox.send_in_transaction(conn, "orders", {"n": 3}, commit)
    assert sent.resolution is Resolution.COMMIT
    assert resolutions(engine, schema) == {first: "COMMIT", second: "ROLLBACK",
                                           sent.message_id: "COMMIT"}


def test_async_connection_commit_rollback_and_two_phase(
    outbox: Outbox, topic: str, engine: Engine, schema: str, settings: Settings, relay: Relay
) -> None:
    async def scenario() -> tuple[int, int, int, int, int]:
        async with await psycopg.AsyncConnection.connect(settings.database_url,
                                                         autocommit=True) as conn:
            async with conn.transaction():
                committed = await outbox.publish(conn, topic, {"n": 1}, key="k")
            with pytest.raises(NotInTransaction):
                await outbox.publish(conn, topic, {"n": 2}, key="k")
            async with conn.transaction():  # psycopg.Rollback rolls the block back
                rolled_back = await outbox.publish(conn, topic, {"n": 3}, key="k")
                raise psycopg.Rollback
            async with conn.transaction():
                prepared = await outbox.prepare(conn, topic, {"n": 4}, key="p")
                dropped = await outbox.prepare(conn, topic, {"n": 5}, key="p")
            async with conn.transaction():
                await outbox.commit(conn, prepared)
                await outbox.rollback(conn, dropped)
            sent = await outbox.send_in_transaction(conn, topic, {"n": 6}, commit, key="s")
            return committed, rolled_back, prepared, dropped, sent.message_id

    committed, rolled_back, prepared, dropped, sent = asyncio.run(scenario())
    wait_delivered(engine, schema, 3)
    delivered = {r.message_id for r in read_topic(settings.kafka_bootstrap, topic)}
    assert delivered == {committed, prepared, sent}
    assert count_status(engine, schema, "ROLLED_BACK") == 1
    assert rolled_back not in delivered and dropped not in delivered


def test_an_unmigrated_schema_says_which_command_to_run(settings: Settings) -> None:
    missing = f"missing_{uuid.uuid4().hex[:8]}"
    outbox = Outbox(settings=settings, schema=missing)
    command = f"outbox --schema {missing} db upgrade"
    with psycopg.connect(settings.database_url) as conn, \
            pytest.raises(SchemaNotMigrated, match=command):
        outbox.publish(conn, "orders", {"n": 1})

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(settings.database_url) as conn:
            await outbox.publish(conn, "orders", {"n": 1})

    with pytest.raises(SchemaNotMigrated, match=command):
        asyncio.run(scenario())


def messages(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {schema}.message")).scalar_one())


def test_a_pipeline_in_autocommit_mode_is_no_transaction(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """Statements queued in a pipeline made the status read ACTIVE, which passed for a
    transaction: the message was written and committed on its own, apart from the writes
    queued before it (sync and async alike). A block inside the pipeline is one."""
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        with conn.pipeline(), pytest.raises(NotInTransaction):
            conn.execute("SELECT 1")
            outbox.publish(conn, "orders", {"n": 1})
        with conn.transaction(), conn.pipeline():
            conn.execute("SELECT 1")
            kept = outbox.publish(conn, "orders", {"n": 2})

    async def scenario() -> int:
        async with await psycopg.AsyncConnection.connect(settings.database_url,
                                                         autocommit=True) as conn:
            async with conn.pipeline():
                await conn.execute("SELECT 1")
                with pytest.raises(NotInTransaction):
                    await outbox.publish(conn, "orders", {"n": 3})
            async with conn.transaction(), conn.pipeline():
                await conn.execute("SELECT 1")
                return await outbox.publish(conn, "orders", {"n": 4})

    assert asyncio.run(scenario()) == kept + 1
    assert messages(engine, schema) == 2


def test_a_decision_on_a_connection_outside_any_transaction_commits_at_once(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """An autocommit connection outside a transaction block decides as an engine does: the
    decision commits at once. It was refused (NotInTransaction), though the application's
    own writes on it commit one by one. A publish there is still refused, and a decision
    in a block still commits or rolls back with it."""
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        with conn.transaction():
            first, second, third = (outbox.prepare(conn, "orders", {"n": n}) for n in range(3))
        outbox.commit(conn, first)
        outbox.rollback(conn, second)
        with pytest.raises(NotInTransaction,
                           match="Engine, or a psycopg, Django or SQLAlchemy AUTOCOMMIT"):
            outbox.publish(conn, "orders", {"n": 4})
        with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
            outbox.commit(conn, third)
            conn.execute("SELECT 1 / 0")
    assert resolutions(engine, schema) == {first: "COMMIT", second: "ROLLBACK",
                                           third: "UNKNOWN"}

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(settings.database_url,
                                                         autocommit=True) as conn:
            await outbox.rollback(conn, third)

    asyncio.run(scenario())
    assert resolutions(engine, schema)[third] == "ROLLBACK"


def test_a_decision_in_an_autocommit_pipeline_commits_at_once(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """An autocommit connection outside a block decides at once, also in pipeline mode (sync
    and async). There the status reads ACTIVE while statements are queued, so the decision
    was refused with NotInTransaction, whose message offers such a connection. A decision in
    a block inside the pipeline still goes with the block."""
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        with conn.transaction():
            first, second, third = (outbox.prepare(conn, "orders", {"n": n}) for n in range(3))
        with conn.pipeline():
            conn.execute("SELECT 1")
            outbox.commit(conn, first)
            with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
                outbox.commit(conn, third)
                conn.execute("SELECT 1 / 0").fetchone()

    async def scenario() -> None:
        connecting = psycopg.AsyncConnection.connect(settings.database_url, autocommit=True)
        async with await connecting as conn, conn.pipeline():
            await conn.execute("SELECT 1")
            await outbox.rollback(conn, second)

    asyncio.run(scenario())
    assert resolutions(engine, schema) == {first: "COMMIT", second: "ROLLBACK",
                                           third: "UNKNOWN"}


def test_a_decision_on_a_sqlalchemy_autocommit_connection_commits_at_once(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """SQLAlchemy's AUTOCOMMIT isolation level opens no transaction in the database, though
    the connection says it is in one: a decision there was refused (NotInTransaction). It
    now commits at once, as on psycopg's own autocommit connection; a publish is refused."""
    with engine.begin() as conn:
        first, second = (outbox.prepare(conn, "orders", {"n": n}) for n in range(2))
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text("SELECT 1"))
        outbox.commit(conn, first)
        with pytest.raises(NotInTransaction, match="not in autocommit mode"):
            outbox.publish(conn, "orders", {"n": 3})
    assert resolutions(engine, schema) == {first: "COMMIT", second: "UNKNOWN"}

    async def scenario() -> None:
        async_engine = create_async_engine(sqlalchemy_url(settings.database_url),
                                           isolation_level="AUTOCOMMIT")
        try:
            async with async_engine.connect() as conn:
                await outbox.rollback(conn, second)
        finally:
            await async_engine.dispose()

    asyncio.run(scenario())
    assert resolutions(engine, schema)[second] == "ROLLBACK"


def test_a_connection_whose_cursors_bind_on_the_server_publishes_and_decides(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """RawCursor takes ``$1`` placeholders only: the publish statement's named ones raised a
    raw TypeError. ClientCursor (binding on the client, for a pooler) is kept as it is."""
    for factory in (psycopg.RawCursor, psycopg.ClientCursor):
        with psycopg.connect(settings.database_url, cursor_factory=factory) as conn:
            prepared = outbox.prepare(conn, "orders", {"n": 1})
            conn.commit()
        with psycopg.connect(settings.database_url, autocommit=True,
                             cursor_factory=factory) as conn:
            outbox.commit(conn, prepared)  # in a transaction of its own
            with conn.transaction():
                outbox.commit(conn, prepared)

    async def scenario() -> int:
        async with await psycopg.AsyncConnection.connect(
                settings.database_url, cursor_factory=psycopg.AsyncRawCursor) as conn:
            message_id = await outbox.publish(conn, "orders", {"n": 2})
            await conn.commit()
            return message_id

    published = asyncio.run(scenario())
    assert len(set(resolutions(engine, schema).values())) == 1
    assert resolutions(engine, schema)[published] == "COMMIT"


def test_a_local_transaction_that_leaves_its_connection_in_a_transaction_is_told_so(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """psycopg opens a transaction at a local transaction's first statement on the same
    connection; the answer's recording was then refused with the prepare row's reason ("call
    it on a connection outside any transaction"), though the row was committed already."""
    with psycopg.connect(settings.database_url) as conn:

        def charge(message: Message) -> str:
            conn.execute("SELECT 1")
            return "COMMIT"

        with pytest.raises(ConfigurationError, match="the local transaction left a "
                           "transaction open") as raised:
            outbox.send_in_transaction(conn, "orders", {"n": 1}, charge)
        conn.rollback()
        message_id = max(resolutions(engine, schema))
        assert f"outbox message {message_id} stays UNKNOWN" in "".join(raised.value.__notes__)
        assert resolutions(engine, schema) == {message_id: "UNKNOWN"}

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(settings.database_url) as conn:

            async def charge(message: Message) -> str:
                await conn.execute("SELECT 1")
                return "COMMIT"

            with pytest.raises(ConfigurationError, match="left a transaction open"):
                await outbox.send_in_transaction(conn, "orders", {"n": 2}, charge)

    asyncio.run(scenario())
    assert sorted(resolutions(engine, schema).values()) == ["UNKNOWN", "UNKNOWN"]


def test_a_closed_or_lost_autocommit_connection_is_reported_as_such(
    outbox: Outbox, settings: Settings
) -> None:
    """A closed or lost connection reads its transaction status as UNKNOWN, which passed for
    a transaction left open or for none: a decision or a publish raised NotInTransaction,
    send_in_transaction ConfigurationError ("call it on a connection outside any
    transaction"), and retry code waiting for psycopg's OperationalError never saw one."""
    closed = psycopg.connect(settings.database_url, autocommit=True)
    closed.close()
    lost = psycopg.connect(settings.database_url, autocommit=True)
    with psycopg.connect(settings.database_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (lost.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        lost.execute("SELECT 1")
    for conn in (closed, lost):
        with pytest.raises(psycopg.OperationalError):
            outbox.commit(conn, 1)
        with pytest.raises(psycopg.OperationalError):
            outbox.publish(conn, "orders", {"n": 1})
        with pytest.raises(psycopg.OperationalError):
            outbox.send_in_transaction(conn, "orders", {"n": 1}, commit)

    async def scenario() -> None:
        conn = await psycopg.AsyncConnection.connect(settings.database_url, autocommit=True)
        await conn.close()
        with pytest.raises(psycopg.OperationalError):
            await outbox.rollback(conn, 1)
        with pytest.raises(psycopg.OperationalError):
            await outbox.publish(conn, "orders", {"n": 1})
        with pytest.raises(psycopg.OperationalError):
            await outbox.send_in_transaction(conn, "orders", {"n": 1}, commit)

    asyncio.run(scenario())


def test_send_in_transaction_on_an_autocommit_pipeline_runs_outside_any_transaction(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """An autocommit connection in pipeline mode, outside any block, is outside any
    transaction; but with statements queued its status reads ACTIVE, so send_in_transaction
    refused it ("call it on a connection outside any transaction"), and refused the answer
    of a local transaction that queued a statement there ("left a transaction open")."""

    def pay(conn: psycopg.Connection[Any]) -> Callable[[Message], str]:
        def local_transaction(message: Message) -> str:
            conn.execute("SELECT 1")
            return "COMMIT"
        return local_transaction

    with psycopg.connect(settings.database_url, autocommit=True) as conn, conn.pipeline():
        conn.execute("SELECT 1")
        committed = outbox.send_in_transaction(conn, "orders", {"n": 1}, pay(conn))

    async def scenario() -> int:
        connecting = psycopg.AsyncConnection.connect(settings.database_url, autocommit=True)
        async with await connecting as conn, conn.pipeline():
            await conn.execute("SELECT 1")

            async def refuse(message: Message) -> str:
                await conn.execute("SELECT 1")
                return "ROLLBACK"

            return (await outbox.send_in_transaction(conn, "orders", {"n": 2}, refuse)
                    ).message_id

    rolled_back = asyncio.run(scenario())
    assert resolutions(engine, schema) == {committed.message_id: "COMMIT",
                                           rolled_back: "ROLLBACK"}


def test_a_publish_cancelled_while_it_waits_for_its_key_aborts_the_transaction(
    outbox: Outbox, engine: Engine, schema: str, settings: Settings
) -> None:
    """``asyncio.timeout()`` around a publish waiting for its key's lock: psycopg cancels the
    statement on the server, so the commit that follows writes neither the business rows nor
    a message, and the connection is usable at once; after the holder's rollback, the retry
    publishes."""

    async def scenario() -> int:
        with psycopg.connect(settings.database_url) as holder:
            outbox.publish(holder, "orders", {"n": 1}, key="k")  # holds the key's lock
            async with await psycopg.AsyncConnection.connect(settings.database_url) as conn:
                await conn.execute("CREATE TEMP TABLE paid (id int)")
                await conn.commit()
                await conn.execute("INSERT INTO paid VALUES (1)")
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await outbox.publish(conn, "orders", {"n": 2}, key="k")
                await conn.commit()
                holder.rollback()
                async with conn.transaction():
                    await conn.execute("INSERT INTO paid VALUES (2)")
                    await outbox.publish(conn, "orders", {"n": 3}, key="k")
                cursor = await conn.execute("SELECT array_agg(id) FROM paid")
                row = await cursor.fetchone()
                assert row is not None and row[0] == [2]
                return len(resolutions(engine, schema))

    assert asyncio.run(scenario()) == 1
