"""The W3C trace context active at publish reaches Kafka with the message."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import wait_delivered


def test_trace_context_at_publish_is_sent_as_kafka_headers(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str, relay: Relay
) -> None:
    tracer = TracerProvider().get_tracer("tests")
    with tracer.start_as_current_span("place-order") as span, \
            Session(engine) as session, session.begin():
        traced = outbox.publish(session, topic, {"order": 1}, key="a")
        context = span.get_span_context()
    with Session(engine) as session, session.begin():
        untraced = outbox.publish(session, topic, {"order": 2}, key="a")
    wait_delivered(engine, schema, 2)

    records = {r.message_id: r for r in read_topic(settings.kafka_bootstrap, topic)}
    traceparent = records[traced].headers["traceparent"].decode()
    version, trace_id, span_id, _flags = traceparent.split("-")
    assert (version, trace_id, span_id) == (
        "00", f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert "traceparent" not in records[untraced].headers
    assert trace.get_current_span() is trace.INVALID_SPAN
