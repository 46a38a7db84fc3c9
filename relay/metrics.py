"""Prometheus metrics of the relay (served with ``outbox relay --metrics-port``)."""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from outbox import store

log = logging.getLogger("outbox.relay")


class BatchHistogram(Collector):
    """A Prometheus histogram observed a batch at a time (the same series as the client's
    ``Histogram``, without ``_created``). ``Histogram.observe`` takes one value a call and
    walks the buckets in Python for each: once per message delivered, that was 3% of a
    draining relay's interpreter time."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_all(self, amounts: Iterable[float]) -> None:
        amounts = list(amounts)
        where = collections.Counter(map(bisect.bisect_left, itertools.repeat(self._bounds),
                                        amounts))  # the first bucket whose bound is ≥ it
        with self._lock:
            for bucket, count in where.items():
                self._counts[bucket] += count
            self._sum += sum(amounts)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        yield HistogramMetricFamily(
            self.name, self.documentation, sum_value=total,
            buckets=[(floatToGoString(bound), cumulative)  # type: ignore[no-untyped-call]
                     for bound, cumulative in zip(self._bounds, itertools.accumulate(counts),
                                                  strict=True)])


DELIVERED = Counter("outbox_messages_delivered", "Messages acknowledged by Kafka", ["topic"])
PARKED = Counter("outbox_messages_parked", "Messages parked after permanent rejection",
                 ["topic"])
FAILURES = Counter("outbox_delivery_failures", "Failed delivery attempts", ["kind"])
#: Every series whose labels are known up front starts at zero, so an alert on a relay that
#: never delivered (or never failed) has a sample to fire on.
FAILURE_KINDS = ("permanent", "retriable", "refused")
for _kind in FAILURE_KINDS:
    FAILURES.labels(_kind)
LATENCY = BatchHistogram(
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
PAUSED = Gauge("outbox_relay_paused",
               "1 while the relay cannot deliver (PostgreSQL or Kafka away, its log says why)")
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
    "1 while the relay holds a topic's messages: Kafka has no metadata for it, refuses its "
    "records or keeps retrying them",
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


def observe_backlog(conn: Connection, schema: str, timeout_seconds: float | None = None
                    ) -> None:
    with conn.begin():
        counts, oldest = store.backlog(conn, schema, timeout_seconds)
    for state, count in counts.items():
        BACKLOG.labels(state).set(count)
    OLDEST_PENDING.set(oldest)


#: The backlog gauges are read again only after this many times what their last count took.
BACKLOG_COUNT_SHARE = 20


class BacklogGauges:
    """The backlog gauges, observed by the lease keeper between renewals, at a cost bounded
    whatever the backlog. Their count reads every row of ``pending`` (12-31 ms at 50,000
    rows, 150-190 ms at 1,000,000), which grows with the backlog, that is in a catch-up
    after an outage, every third of a lease per relay. So a count is cut off after
    ``timeout_seconds`` (the gauges keep their last values, and the renewal is late by that
    much at most), and the next one waits :data:`BACKLOG_COUNT_SHARE` times what the last
    took: at most a twentieth of a database backend's time."""

    def __init__(self, schema: str, timeout_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.schema, self.timeout_seconds, self._clock = schema, timeout_seconds, clock
        #: clock time of the next count
        self.due = -math.inf
        self._cut_off = False  # the last count was (warned once, then at DEBUG)

    def observe(self, conn: Connection) -> None:
        started = self._clock()
        if started < self.due:
            return
        try:
            observe_backlog(conn, self.schema, self.timeout_seconds)
            if self._cut_off:
                log.info("relay: the backlog is counted again (the outbox_messages gauges)")
                self._cut_off = False
        except OperationalError as exc:
            if not store.cut_off(exc):
                raise
            log.log(logging.DEBUG if self._cut_off else logging.WARNING,
                    "relay: counting the backlog took over %gs (pending holds many rows): the "
                    "outbox_messages gauges keep their last values until a count ends in time",
                    self.timeout_seconds)
            self._cut_off = True
        finally:
            self.due = started + (self._clock() - started) * BACKLOG_COUNT_SHARE
