"""Delayed delivery works with transactions and keeps per-key order (docs/guarantees.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import InvalidMessage, Outbox
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
