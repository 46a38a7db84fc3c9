"""Opt-in CloudEvents: the Kafka binding's binary-mode headers, read back by the SDK."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary_event
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import InvalidMessage, Outbox
from outbox.dev.topics import Record, read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import wait_delivered


def as_event(record: Record) -> BaseCloudEvent:
    return from_binary_event(KafkaMessage(headers=record.headers, key=record.key,
                                          value=record.value))


def test_outbox_wide_and_per_publish_cloudevents_reach_the_consumer(
    settings: Settings, engine: Engine, schema: str, topic: str, relay: Relay
) -> None:
    plain = Outbox(settings=settings)
    events = Outbox(settings=settings, cloudevents_source="urn:order-service")
    before = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        untouched = plain.publish(session, topic, {"n": 0}, key="a")
        by_topic = events.publish(session, topic, {"n": 1}, key="a")
        typed = events.publish(session, topic, {"n": 2}, key="a",
                               cloudevent_type="com.example.order.placed")
        per_call = plain.publish(session, topic, "hi", key="a", cloudevent_type="greeting",
                                 cloudevent_source="/elsewhere")
    wait_delivered(engine, schema, 4)
    records = {r.message_id: r for r in read_topic(settings.kafka_bootstrap, topic)}

    assert not any(name.startswith("ce_") for name in records[untouched].headers)
    first = as_event(records[by_topic])
    assert (first.get_type(), first.get_source(), first.get_data()) == (
        topic, "urn:order-service", {"n": 1})
    assert uuid.UUID(first.get_id())
    assert before - timedelta(seconds=1) <= first.get_time() <= datetime.now(UTC)
    assert first.get_datacontenttype() == "application/json"
    assert as_event(records[typed]).get_type() == "com.example.order.placed"
    greeting = as_event(records[per_call])
    assert (greeting.get_type(), greeting.get_source(), greeting.get_data()) == (
        "greeting", "/elsewhere", "hi")
    assert first.get_id() != as_event(records[typed]).get_id()


def test_a_cloudevent_without_a_source_is_refused(outbox: Outbox, engine: Engine) -> None:
    with Session(engine) as session, session.begin(), \
            pytest.raises(InvalidMessage, match="cloudevent_source"):
        outbox.publish(session, "orders", {"n": 1}, cloudevent_type="order.placed")
