"""Prometheus metrics of the relay (served with ``outbox relay --metrics-port``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from sqlalchemy import Connection

from outbox import store
from outbox.exceptions import ConfigurationError

DELIVERED = Counter("outbox_messages_delivered", "Messages acknowledged by Kafka", ["topic"])
PARKED = Counter("outbox_messages_parked", "Messages parked after permanent rejection",
                 ["topic"])
FAILURES = Counter("outbox_delivery_failures", "Failed delivery attempts", ["kind"])
#: Every series whose labels are known up front starts at zero, so an alert on a relay that
#: never delivered (or never failed) has a sample to fire on.
FAILURE_KINDS = ("permanent", "retriable")
for _kind in FAILURE_KINDS:
    FAILURES.labels(_kind)
LATENCY = Histogram(
    "outbox_delivery_latency_seconds",
    "From the start of the transaction that wrote the prepare row to the recorded broker ack "
    "(includes deliberate delays and waits for a two-phase decision)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BATCH_SIZE = Histogram(
    "outbox_relay_batch_size", "Messages per relay batch",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
)
TAIL_RECORDS = Counter(
    "outbox_relay_tail_records_read",
    "Records read from partition tails before delivering shards whose sends may be unrecorded",
)
RECOVERED = Counter(
    "outbox_relay_recovered",
    "Messages found already in Kafka by a tail read and recorded instead of sent again",
)
OWNED_SHARDS = Gauge("outbox_relay_owned_shards", "Shards whose lease this relay holds")
BACKLOG = Gauge(
    "outbox_messages", "Undelivered messages by state (pending is like rocketmq_half_messages)",
    ["state"],
)
OLDEST_PENDING = Gauge(
    "outbox_oldest_pending_seconds",
    "How long the oldest committed, undelivered message has waited (0 when none waits)",
)

TOPIC_HELD = Gauge(
    "outbox_topic_held",
    "1 while the relay holds a topic's messages because Kafka has no metadata for it",
    ["topic"],
)

_topics_seen: set[str] = set()


def topics_seen(topics: Iterable[str]) -> None:
    """Start a topic's delivered and parked series at zero when the relay first fetches it
    (topics are not known before: they are whatever applications publish to)."""
    for topic in set(topics) - _topics_seen:
        DELIVERED.labels(topic)
        PARKED.labels(topic)
        _topics_seen.add(topic)


def observe_backlog(conn: Connection, schema: str) -> None:
    with conn.begin():
        counts, oldest = store.backlog(conn, schema)
    for state, count in counts.items():
        BACKLOG.labels(state).set(count)
    OLDEST_PENDING.set(oldest)


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve /metrics; a port in use or not ours to bind is a configuration error."""
    try:
        start_http_server(port, addr=address)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}; "
            "choose another --metrics-port") from None
