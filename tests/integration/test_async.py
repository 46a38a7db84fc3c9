"""The async SQLAlchemy path shares the sync one's behaviour."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from outbox import Outbox
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import wait_delivered


def test_async_session_commit_is_delivered_and_rollback_is_not(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    async def scenario() -> tuple[list[int], int]:
        async_engine = create_async_engine(sqlalchemy_url(settings.database_url))
        try:
            async with AsyncSession(async_engine) as session, session.begin():
                committed = [await outbox.publish(session, topic, {"n": n}, key="a")
                             for n in range(3)]
            async with AsyncSession(async_engine) as session:
                await session.begin()
                rolled_back = await outbox.publish(session, topic, {"n": 99}, key="a")
                await session.rollback()
            async with async_engine.begin() as conn:
                committed.append(await outbox.publish(conn, topic, {"n": 3}, key="a"))
            return committed, rolled_back
        finally:
            await async_engine.dispose()

    committed, rolled_back = asyncio.run(scenario())
    wait_delivered(engine, schema, 4)
    delivered = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)]
    assert delivered == committed
    assert rolled_back not in delivered


def test_async_publish_outside_a_transaction_is_rejected(outbox: Outbox,
                                                         settings: Settings) -> None:
    from outbox import NotInTransaction

    async def scenario() -> str:
        async_engine = create_async_engine(sqlalchemy_url(settings.database_url))
        try:
            async with AsyncSession(async_engine) as session:
                try:
                    await outbox.publish(session, "t", {"n": 1})
                except NotInTransaction as exc:
                    return str(exc)
                return "no error"
        finally:
            await async_engine.dispose()

    assert "open transaction" in asyncio.run(scenario())
