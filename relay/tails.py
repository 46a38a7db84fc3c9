"""Reading a topic's partition tails for ``outbox-id`` headers (relay/recovery.py's input).

A tail ends at the high-watermark taken from the fetch responses of a consumer made for this
read (never a stale one, and never ListOffsets "latest", which some Kafka-compatible brokers
answer wrongly): every record Kafka acknowledged before the read began is below it. A tail
with no recorded offset starts at offset 0, not where ListOffsets "earliest" says: the
embedded broker answers with the batch it stored first, which two producers writing one
partition can make a later one (and the records below it were not read). Where retention
took offset 0, the consumer's reset ("earliest") starts the read at the log's start. The
consumer is assigned its partitions (no consumer group). A reader looks the topics' partition
counts up on one consumer of its own, made at its first look-up, which
:meth:`TailReader.close` closes: a consumer per look-up cost a bootstrap each (a metadata
request for every topic of the cluster), and with the read's own, a takeover over 5,000
topics took half an hour. One read takes the partitions of many topics, up to the reader's
``partitions_per_read`` (relay/recovery.py): a consumer per topic cost about 0.04 s
(kafka-python) to 0.6 s (librdkafka) a topic before its first record.
kafka-python's reader is here, librdkafka's in relay/confluent.py; :func:`make_tail_reader`
picks the transport's.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from outbox.encoding import ID_HEADER, header_message_id
from outbox.exceptions import ServiceUnavailable
from outbox.settings import RelaySettings

#: A read that gets no record and does not reach the end for this long has failed.
STALL_SECONDS = 15.0


#: A record as a pending message is matched with it: the message id its ``outbox-id`` header
#: names, its topic, its key, and the SHA-256 of its value. The id alone is not enough: every
#: outbox numbers its messages from 1, and two of them (two services, two schemas) may
#: publish to one topic.
Fingerprint = tuple[int, str, bytes | None, bytes]
#: Where a read starts in each ``(topic, partition)``: an offset, or None for its beginning
#: (:data:`LOG_START`).
Starts = Mapping[tuple[str, int], int | None]
#: where a tail with no recorded offset starts (the module's docstring says why not "earliest")
LOG_START = 0


def fingerprint(message_id: int, topic: str, key: bytes | None, value: bytes | None
                ) -> Fingerprint:
    return message_id, topic, key, hashlib.sha256(value or b"").digest()


@dataclass
class Tail:
    """What a read found: each fingerprint's first ``(partition, offset)``."""

    found: dict[Fingerprint, tuple[int, int]] = field(default_factory=dict)
    records: int = 0
    #: False when the read stopped at its record limit before the high-watermark
    complete: bool = True

    def add(self, topic: str, partition: int, offset: int, key: bytes | None,
            value: bytes | None, headers: Iterable[tuple[str, str | bytes | None]] | None
            ) -> None:
        self.records += 1
        for name, header in reversed(list(headers or ())):  # the relay appends it last but one
            if name == ID_HEADER and header is not None:
                message_id = header_message_id(header)
                if message_id is not None:
                    self.found.setdefault(fingerprint(message_id, topic, key, value),
                                          (partition, offset))
                return

    def ids(self) -> list[int]:
        """The message ids found, each once."""
        return sorted({message_id for message_id, *_ in self.found})


class TailReader(Protocol):
    #: partitions a read takes at most (relay/recovery.py splits a settle's reads so)
    partitions_per_read: int

    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (0 if it does not exist)."""
        ...

    def read(self, starts: Starts, limit: int) -> Tail:
        """Read each ``(topic, partition)`` from its start offset (None: its beginning) to its
        high-watermark, with one consumer, at most ``limit`` records in all."""
        ...

    def close(self) -> None:
        """Close the reader's consumer, if it made one."""
        ...


class Stopped(Exception):
    """The relay was told to stop while it read a tail: the read ends, and the shards being
    settled stay unsettled for their next owner."""


class Stall:
    """Raises :class:`ServiceUnavailable` when a read makes no progress for too long, and
    :class:`Stopped` once the relay is told to stop (checked every poll)."""

    def __init__(self, bootstrap: str, stop: threading.Event) -> None:
        self._bootstrap = bootstrap
        self._stop = stop
        self._deadline = time.monotonic() + STALL_SECONDS

    def progressed(self) -> None:
        self._deadline = time.monotonic() + STALL_SECONDS

    def check(self) -> None:
        if self._stop.is_set():
            raise Stopped
        if time.monotonic() > self._deadline:
            raise ServiceUnavailable(f"Kafka at {self._bootstrap} did not serve a partition's "
                                     f"tail for {STALL_SECONDS:.0f}s")


class KafkaPythonTailReader:
    """Tails read with a kafka-python consumer of their own."""

    #: 1,000 topics of 4 partitions, one record each, on the embedded broker: 4.95 s in
    #: reads of 100 partitions (a consumer's start is most of it), 3.2 s in reads of 1,000,
    #: 4.2 s in reads of 2,000 (BENCHMARKS.md, "Tail reads")
    partitions_per_read = 1_000

    def __init__(self, settings: RelaySettings, stop: threading.Event | None = None) -> None:
        self._bootstrap = settings.kafka_bootstrap
        self._stop = stop or threading.Event()
        self._lookups: KafkaConsumer | None = None
        self._config: dict[str, Any] = {
            "bootstrap_servers": settings.kafka_bootstrap.split(","),
            "client_id": f"outbox-recovery-{settings.worker_id}",
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "fetch_max_wait_ms": 10,  # an empty tail ends after one short fetch
            **settings.kafka_python_connection(),
        }

    def _consumer(self) -> KafkaConsumer:
        try:
            return KafkaConsumer(**self._config)
        except KafkaError as exc:
            raise ServiceUnavailable(f"no Kafka broker answers at {self._bootstrap} ({exc})"
                                     ) from None

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
            self._lookups = None

    def partitions(self, topic: str) -> int:
        """From the look-up consumer's metadata of every topic, asked for once (again only
        for a topic it did not list)."""
        if self._lookups is None:
            self._lookups = self._consumer()
        try:
            return len(self._lookups.partitions_for_topic(topic) or ())
        except KafkaError as exc:
            self.close()
            raise ServiceUnavailable(f"no metadata for topic {topic} ({exc})") from None

    def read(self, starts: Starts, limit: int) -> Tail:
        tail = Tail()
        consumer = self._consumer()
        try:
            tps = {TopicPartition(topic, p): start for (topic, p), start in starts.items()}
            consumer.assign(list(tps))
            for tp, start in tps.items():
                consumer.seek(tp, LOG_START if start is None else start)
            stall = Stall(self._bootstrap, self._stop)
            ends = _Ends(consumer, tps)
            while ends.open:
                if tail.records >= limit:
                    tail.complete = False
                    break
                stall.check()
                polled = consumer.poll(timeout_ms=200,
                                       max_records=min(10_000, limit - tail.records))
                for tp, batch in polled.items():
                    stall.progressed()
                    for record in batch:
                        tail.add(record.topic, record.partition, record.offset, record.key,
                                 record.value, record.headers)
                    ends.read_to(tp, batch[-1].offset + 1)
                if ends.close_reached(idle=not polled):
                    stall.progressed()
            return tail
        except KafkaError as exc:
            raise ServiceUnavailable(f"could not read the tails of {named(starts)} ({exc})"
                                     ) from None
        finally:
            consumer.close()


class _Ends:
    """Which partitions of a kafka-python read have yet to reach their high-watermark.

    Each partition's position is followed from the records polled, and asked of the consumer
    (``position()``) only on a poll that returned nothing, for the partitions still open (a
    tail may end past its last record: retention, control records). ``position()`` walks every
    assigned partition, so asking it of each partition on every turn cost the square of the
    read's partitions: a read of 1,000 spent 92% of its samples in that test, 72% in
    ``position()`` (BENCHMARKS.md, "Tail reads"). A partition that reaches its end is paused:
    its next fetches leave it out.
    """

    def __init__(self, consumer: KafkaConsumer, starts: Mapping[TopicPartition, int | None]
                 ) -> None:
        self._consumer = consumer
        self._next = dict(starts)

    @property
    def open(self) -> bool:
        return bool(self._next)

    def read_to(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._next:
            self._next[tp] = offset

    def close_reached(self, *, idle: bool) -> bool:
        """Close the partitions at their ends; whether any was."""
        reached = []
        for tp, offset in self._next.items():
            high = self._consumer.highwater(tp)
            if high is None:
                continue  # not fetched yet
            told = high == 0 or (offset is not None and offset >= high)
            if told or (idle and self._consumer.position(tp) >= high):
                reached.append(tp)
        for tp in reached:
            del self._next[tp]
        if reached:
            self._consumer.pause(*reached)
        return bool(reached)


def named(starts: Starts) -> str:
    """The topics of a read, for an error: the first three and how many more."""
    topics = sorted({topic for topic, _ in starts})
    more = f" and {len(topics) - 3} more" if len(topics) > 3 else ""
    return "topic" + ("s " if len(topics) > 1 else " ") + ", ".join(topics[:3]) + more


def make_tail_reader(settings: RelaySettings, stop: threading.Event | None = None
                     ) -> TailReader:
    """The tail reader of the transport ``settings.kafka_client`` names; ``stop`` set ends
    a read (:class:`Stall`)."""
    if settings.kafka_client == "confluent":
        from outbox.relay.confluent import ConfluentTailReader

        return ConfluentTailReader(settings, stop)
    return KafkaPythonTailReader(settings, stop)
