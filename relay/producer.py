"""The default transport, kafka-python: acks=all, idempotent, ids in headers."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError, UnknownTopicOrPartitionError
from kafka.future import Future
from kafka.partitioner.default import DefaultPartitioner, murmur2

from outbox.exceptions import ServiceUnavailable
from outbox.relay.transport import Delivery, Headers, unknown_offset
from outbox.settings import RelaySettings
from outbox.tls_probe import require_tls_answer

PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    # Idempotence keeps order with up to 5 requests in flight per partition.
    "max_in_flight_requests_per_connection": 5,
    "linger_ms": 1,
    "batch_size": 256 * 1024,
    # kafka-python's own sensors (the relay has its Prometheus metrics): recording them
    # took a tenth of its network thread's time at 1,000 msg/s.
    "metrics_enabled": False,
}


#: How much longer a metadata request is awaited for each topic it lists.
ASK_SECONDS_PER_TOPIC = 0.005


class _AskedAbout(logging.Filter):
    """Drops kafka-python's ERROR or WARNING line for a topic a relay asked about and its
    metadata lacked: the relay holds such a topic and says so itself, in one line for many
    (holds.py); kafka-python said a line per topic on every metadata answer. Topics no
    relay asked about (an application's own clients in the process) keep theirs."""

    LINES = frozenset({
        "Topic %s not found in cluster metadata",
        "Topic %s is not authorized for this client",
        "Topic %s is not available during auto-create initialization",
    })

    def __init__(self) -> None:
        super().__init__()
        self.topics: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg in self.LINES and isinstance(record.args, tuple)
                    and record.args and record.args[0] in self.topics)


_ASKED_ABOUT = _AskedAbout()
logging.getLogger("kafka.cluster").addFilter(_ASKED_ABOUT)


class KeyHashPartitioner(DefaultPartitioner):  # type: ignore[misc]  # kafka-python is untyped
    """kafka-python's default partitioner (a key's murmur2 hash over the sorted partitions,
    as Java clients and librdkafka's ``murmur2_random``), remembering each key's hash and
    each topic's sorted partitions: kafka-python hashes in pure Python on every send (1.5 µs
    for a 7-byte key, 3.9 µs for 26 bytes), a relay sends the same keys again and again, and
    listing and sorting a topic's partitions took 4% of a draining relay's interpreter time.
    The memo of hashes is emptied when it holds ``size`` keys; the partitions are forgotten
    on every metadata update (a topic made again with more partitions moves its keys as
    kafka-python's own partitioner does)."""

    def __init__(self, size: int = 100_000) -> None:
        self.size = size
        self.hashes: dict[bytes, int] = {}
        #: topic → its partitions, sorted; replaced (not emptied) on a metadata update, so a
        #: list read from metadata older than the update lands in the dict it replaced
        self.sorted: dict[str, list[int]] = {}
        self._heard: Any = None  # the metadata whose updates this listens to

    def partition(self, topic: str, key: Any, serialized_key: bytes | None, value: Any,
                  serialized_value: Any, cluster: Any) -> int:
        if serialized_key is None:
            return int(super().partition(topic, key, serialized_key, value, serialized_value,
                                         cluster))
        if cluster is not self._heard:
            cluster.add_listener(self._forget)
            self._heard, self.sorted = cluster, {}
        known = self.sorted
        partitions = known.get(topic)
        if partitions is None:
            found = cluster.partitions_for_topic(topic)
            if not found:
                return int(super().partition(topic, key, serialized_key, value,
                                             serialized_value, cluster))
            partitions = known[topic] = sorted(found)
        hashed = self.hashes.get(serialized_key)
        if hashed is None:
            if len(self.hashes) >= self.size:
                self.hashes.clear()
            hashed = self.hashes[serialized_key] = murmur2(serialized_key) & 0x7FFFFFFF
        return partitions[hashed % len(partitions)]

    def _forget(self, _cluster: Any) -> None:
        self.sorted = {}


def request_timeout_ms(settings: RelaySettings) -> int:
    """How long the producer waits for the answer to one request: the clients' 30 s, or less
    so that a request ends within the delivery timeout (kafka-python refuses to start with a
    delivery timeout under linger + request timeout)."""
    return min(30_000, settings.kafka_delivery_timeout_ms - int(PRODUCER_DEFAULTS["linger_ms"]))


def producer_config(settings: RelaySettings, **overrides: Any) -> dict[str, Any]:
    return {
        **PRODUCER_DEFAULTS,
        "request_timeout_ms": request_timeout_ms(settings),
        "partitioner": KeyHashPartitioner(),
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "client_id": f"outbox-relay-{settings.worker_id}",
        "delivery_timeout_ms": settings.kafka_delivery_timeout_ms,
        "max_request_size": settings.kafka_max_request_size,
        **settings.kafka_python_connection(),
        **overrides,
    }


class NamedProducer(KafkaProducer):  # type: ignore[misc]  # kafka-python is untyped
    """kafka-python's producer, its name formatted once: ``send()`` formats it for a debug
    line on every record, logged or not."""

    @functools.cached_property
    def _name(self) -> str:
        return str(super().__str__())

    def __str__(self) -> str:
        return self._name


def make_producer(settings: RelaySettings, **overrides: Any) -> KafkaProducer:
    settings.require("kafka_bootstrap")
    require_tls_answer(settings)  # kafka-python's handshake has no deadline
    try:
        return NamedProducer(**producer_config(settings, **overrides))
    except KafkaTimeoutError:
        raise settings.kafka_unreachable() from None


class KafkaPythonTransport:
    """kafka-python's producer behind the relay's transport seam (relay/transport.py)."""

    fetch_ahead = True  # send() is two thirds of the loop's time draining a backlog

    def __init__(self, settings: RelaySettings) -> None:
        self.producer = make_producer(settings)
        self._metadata = self.producer._metadata  # kafka-python's ClusterMetadata
        #: one look-up at a time: the main loop's and the recorder's (relay.py) would drop
        #: each other's topics from the metadata
        self._asking = threading.Lock()
        self.denied: frozenset[str] = frozenset()

    def send(self, topic: str, key: bytes | None, value: bytes, headers: Headers) -> Delivery:
        """Sends a record of a topic :meth:`available` found; one whose metadata the
        producer has lost since (a deleted topic) fails at once, where kafka-python would
        block for ``max_block_ms`` (a minute) waiting for it to come back."""
        if topic not in self._metadata._partitions:
            return Sent(Future().failure(UnknownTopicOrPartitionError(topic)))
        try:
            future = self.producer.send(topic, value=value, key=key, headers=headers
                                        if type(headers) is list else list(headers))
        except KafkaError as exc:  # refused before sending: size, ...
            future = Future().failure(exc)
        return Sent(future)

    def unsent(self, error: BaseException) -> Delivery:
        return Sent(Future().failure(error))

    def wait(self, deliveries: Sequence[Delivery], timeout: float) -> bool:
        """Looks at each record's future; waits in ``get()`` on the first not done (which
        follows the record into a new batch if kafka-python splits its batch for size)."""
        deadline = time.monotonic() + timeout
        for delivery in deliveries:
            future = delivery.future  # type: ignore[attr-defined]  # only Sent is sent here
            if future.is_done:
                continue
            left = deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(Exception):  # a failed record has settled too
                    future.get(left)
            if not future.is_done:
                return False
        return True

    def available(self, topics: Collection[str], timeout: float) -> set[str]:
        """Known topics answer from the producer's cache; for the others, one metadata
        request is awaited (kafka-python has no public call that does not block for
        ``max_block_ms``). A topic still unknown is then dropped from the producer's
        metadata, or kafka-python would re-request it, logging an error, ten times a second."""
        metadata = self._metadata
        found = {topic for topic in topics if metadata.partitions_for_topic(topic) is not None}
        asked = set(topics) - found
        if not asked:
            return found
        with self._asking:
            return found | self._ask(asked, timeout)

    def _ask(self, asked: set[str], timeout: float) -> set[str]:
        """One metadata request for every topic the producer tracks, ``asked`` added: its
        answer is awaited ``timeout`` plus ``ASK_SECONDS_PER_TOPIC`` for each topic it
        lists, as it takes longer the more it lists (over 1 s for 3,000 new topics here).
        The tracked set is replaced, not changed in place: the sender thread may be
        iterating it for a request (kafka-python failed a refresh with "Set changed size
        during iteration")."""
        metadata = self._metadata
        _ASKED_ABOUT.topics |= asked
        answered = threading.Event()
        before = metadata._last_successful_refresh_ms
        metadata._topics = metadata._topics | asked
        metadata.request_update().add_both(lambda *_: answered.set())
        self.producer._sender.wakeup()
        waited = timeout + ASK_SECONDS_PER_TOPIC * len(metadata._topics)
        answered.wait(waited)
        found = {topic for topic in asked if metadata.partitions_for_topic(topic) is not None}
        self.denied = self.denied - asked | (asked & metadata.unauthorized_topics) - found
        metadata._topics = metadata._topics - (asked - found)
        if found < asked and metadata._last_successful_refresh_ms == before:
            raise ServiceUnavailable(f"Kafka did not answer a metadata request about "
                                     f"{len(asked)} topics within {waited:g}s")
        return found

    def flush(self, timeout: float) -> None:
        self.producer.flush(timeout)

    def broken(self) -> bool:
        manager = self.producer._transaction_manager  # None unless idempotent
        return manager is not None and bool(manager.has_fatal_error())

    def close(self, timeout: float) -> None:
        if self.producer._closed:  # closed already (a relay that stepped aside)
            return
        try:
            self.producer.flush(timeout)
        except KafkaTimeoutError:
            # kafka-python's close() raises this too while records wait for a broker; they
            # stay pending in the database, so drop them (it has no public call for that).
            self.producer._sender.force_close()
            self.producer._sender.join(5)
        self.producer.close(timeout=0)


class Sent:
    """A record handed to kafka-python: its future, read once settled. No callbacks: adding
    two per record and running them took a fifth to a quarter of raw kafka-python's rate,
    and the relay drained 1.09-1.18x faster without them (BENCHMARKS.md, session 13)."""

    __slots__ = ("future",)

    def __init__(self, future: Any) -> None:
        self.future = future

    @property
    def error(self) -> BaseException | None:
        future = self.future
        if future.exception is not None:
            return future.exception  # type: ignore[no-any-return]
        if future.is_done and future.value.offset < 0:
            return unknown_offset(future.value.partition)
        return None

    @property
    def partition(self) -> int:
        return self.future.value.partition  # type: ignore[no-any-return]

    @property
    def offset(self) -> int:
        return self.future.value.offset  # type: ignore[no-any-return]
