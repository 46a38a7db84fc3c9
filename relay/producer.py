"""The Kafka producer the relay sends with: acks=all, idempotent, ids in headers."""

from __future__ import annotations

from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from outbox.exceptions import ServiceUnavailable
from outbox.settings import RelaySettings

PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    # Idempotence keeps order with up to 5 requests in flight per partition.
    "max_in_flight_requests_per_connection": 5,
    "linger_ms": 1,
    "batch_size": 256 * 1024,
    "bootstrap_timeout_ms": 15_000,
}


def producer_config(settings: RelaySettings, **overrides: Any) -> dict[str, Any]:
    return {
        **PRODUCER_DEFAULTS,
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "client_id": f"outbox-relay-{settings.worker_id}",
        "delivery_timeout_ms": settings.kafka_delivery_timeout_ms,
        "max_request_size": settings.kafka_max_request_size,
        **settings.kafka_security(),
        **overrides,
    }


def make_producer(settings: RelaySettings, **overrides: Any) -> KafkaProducer:
    settings.require("kafka_bootstrap")
    try:
        return KafkaProducer(**producer_config(settings, **overrides))
    except KafkaTimeoutError:
        raise ServiceUnavailable(
            f"no Kafka broker answers at {settings.kafka_bootstrap}: check OUTBOX_KAFKA_BOOTSTRAP"
        ) from None
