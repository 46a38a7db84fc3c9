"""Delayed delivery works with transactions and keeps per-key order (docs/guarantees.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import InvalidMessage, Outbox, store
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import count_status, publish_orders, wait_delivered


def test_delayed_message_is_held_until_due_and_its_key_waits_behind_it(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    with Session(engine) as session, session.begin():
        delayed = outbox.publish(session, topic, {"n": 1}, key="k",
                                 deliver_after=timedelta(seconds=2))
        behind = outbox.publish(session, topic, {"n": 2}, key="k")
        other = outbox.publish(session, topic, {"n": 3}, key="other")
    published = time.monotonic()
    wait_delivered(engine, schema, 1, timeout=10)
    assert [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)] == [other]
    assert count_status(engine, schema, "DELAYED") == 1

    wait_delivered(engine, schema, 3, timeout=15)
    assert time.monotonic() - published >= 1.5
    by_key = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)
              if r.key == b"k"]
    assert by_key == [delayed, behind]


def test_deliver_at_in_the_past_is_delivered_at_once(
    engine: Engine, outbox: Outbox, topic: str, schema: str, relay: Relay
) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, "late", deliver_at=datetime.now(UTC) - timedelta(hours=1))
    wait_delivered(engine, schema, 1, timeout=10)


def test_rolled_back_delayed_message_is_never_delivered(
    engine: Engine, outbox: Outbox, topic: str, schema: str, relay: Relay
) -> None:
    with Session(engine) as session:
        session.begin()
        outbox.publish(session, topic, "x", deliver_after=timedelta(seconds=0.2))
        session.rollback()
    publish_orders(engine, outbox, topic, [("k", 1)])
    wait_delivered(engine, schema, 1, timeout=10)
    time.sleep(0.5)
    assert count_status(engine, schema, "DELIVERED") == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"deliver_after": timedelta(seconds=-1)}, "deliver_after must be a timedelta"),
        ({"deliver_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"deliver_after": timedelta(1), "deliver_at": datetime.now(UTC)}, "not both"),
    ],
)
def test_bad_delivery_times_are_rejected(engine: Engine, outbox: Outbox,
                                         kwargs: dict[str, object], error: str) -> None:
    with Session(engine) as session, session.begin(), pytest.raises(InvalidMessage, match=error):
        outbox.publish(session, "t", "x", **kwargs)  # type: ignore[arg-type]


def test_a_takeover_looks_for_a_delayed_message_from_when_it_fell_due(
    engine: Engine, outbox: Outbox, topic: str, schema: str
) -> None:
    """A takeover reads each partition's tail from the last record written before the
    earliest moment a pending message can have been sent. For a delayed message that was its
    commit (days ago) or the shard's last settling (a relay's start, days ago too), so the
    read went back days, or to the start of the partition, for a message sent a moment ago."""
    with Session(engine) as session, session.begin():
        message_id = outbox.publish(session, topic, "due", key="k",
                                    deliver_after=timedelta(days=2))
    with engine.begin() as conn:  # as if committed 2 days ago and fallen due just now
        due, shard = conn.execute(text(
            f"UPDATE {schema}.pending SET status = 'PENDING', "
            f"created_at = now() - interval '2 days', deliver_after = now() - interval '1s' "
            f"WHERE message_id = :id RETURNING deliver_after, shard"), {"id": message_id}).one()
        conn.execute(text(  # its shard settled by a relay that started a day ago
            f"INSERT INTO {schema}.relay_lease (shard, owner, expires_at, clean, settled_at) "
            f"VALUES (:shard, 'gone', now(), false, now() - interval '1 day') "
            f"ON CONFLICT (shard) DO UPDATE SET settled_at = EXCLUDED.settled_at"),
            {"shard": shard})
        assert store.unrecorded_candidates(conn, schema, [shard]) == [(topic, b"k", due)]
