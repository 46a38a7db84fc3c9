"""A PySpark Python data source that reads Kafka offset ranges with kafka-python, or with
confluent-kafka (librdkafka, several times faster) when the ``confluent`` extra is installed
and ``kafka_client`` is ``confluent``.

No spark-sql-kafka jar is needed: each Spark partition is one offset range of one
topic-partition, read by its own consumer with ``assign()`` (no consumer group joins: a
confluent-kafka ``subscribe()`` waits on group joins some brokers serve slowly). Ranges end
at the high-watermark taken from fetch responses, which every Kafka-compatible broker
reports correctly (ListOffsets "latest" is not reliable on all of them).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from outbox.encoding import ID_HEADER, header_message_id
from outbox.exceptions import ServiceUnavailable

FORMAT = "outbox_kafka"
SCHEMA = pa.schema([
    ("topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("outbox_id", pa.int64()),
])
SPARK_SCHEMA = "topic string, partition int, offset long, outbox_id long"
_CONSUMER: dict[str, Any] = {
    "group_id": None,
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    "fetch_max_bytes": 64 * 1024 * 1024,
    "max_partition_fetch_bytes": 16 * 1024 * 1024,
    "request_timeout_ms": 30_000,
}
#: The same for librdkafka. Its consumer needs a group id even with ``assign()``; nothing is
#: committed under it and it never joins the group.
_RDKAFKA: dict[str, Any] = {
    "group.id": "outbox-reconcile",
    # A range that starts below what Kafka still keeps (topic retention) reads from the
    # first record kept, as kafka-python's reader does; librdkafka's default jumped to the
    # partition's end and read the whole range as empty.
    "auto.offset.reset": "earliest",
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    # Told when the fetch reaches a partition's end: a range whose last offsets are not
    # records (transaction markers) ends there, as no record comes for them.
    "enable.partition.eof": True,
    "fetch.max.bytes": 64 * 1024 * 1024,
    "max.partition.fetch.bytes": 16 * 1024 * 1024,
    "queued.max.messages.kbytes": 256 * 1024,
    # When its queue holds queued.min.messages (100,000), librdkafka stops fetching for this
    # long: 1 s by default, which left the reader idle three quarters of the time.
    "fetch.queue.backoff.ms": 10,
    "socket.timeout.ms": 30_000,
}
#: The Kafka clients the reader can use (settings.KafkaSettings.kafka_client).
CLIENTS = ("kafka-python", "confluent")
#: The option naming the SASL password in each client's settings (it travels on its own).
PASSWORD_OPTION = {"kafka-python": "sasl_plain_password", "confluent": "sasl.password"}


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """Offsets ``[start, end)`` of one topic-partition: one Spark partition."""

    topic: str
    partition: int
    start: int
    end: int


def split(ranges: list[OffsetRange], max_records: int) -> list[OffsetRange]:
    """Cut long ranges into pieces of at most ``max_records`` so they read in parallel."""
    pieces = []
    for r in ranges:
        for start in range(r.start, r.end, max_records):
            pieces.append(OffsetRange(r.topic, r.partition, start, min(r.end, start + max_records)))
    return pieces


@dataclass(frozen=True)
class LogBounds:
    """What a reconciliation asks of each partition before it reads: where it ends, and
    which record it begins with (a topic deleted and recreated begins with another)."""

    #: {(topic, partition): the next offset}
    ends: dict[tuple[str, int], int]
    #: {(topic, partition): (offset, timestamp in ms) of its first record}, where it has one
    heads: dict[tuple[str, int], tuple[int, int]]


def log_bounds(bootstrap: str, topics: list[str], client: dict[str, Any] | None = None,
               timeout: float = 60.0) -> LogBounds:
    """The high-watermark of every partition of ``topics`` that exist, from fetch responses,
    and its first record, which the same fetches bring (from the partition's start).

    ``client``: extra kafka-python settings (security) for the consumer.
    """
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), **{
        **_CONSUMER, "max_partition_fetch_bytes": 1024, "fetch_max_bytes": 64 * 1024,
        **(client or {})})
    try:
        existing = consumer.topics()
        partitions = [TopicPartition(topic, p) for topic in sorted(set(topics) & existing)
                      for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return LogBounds({}, {})
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        heads: dict[tuple[str, int], tuple[int, int]] = {}
        deadline = time.monotonic() + timeout
        while True:
            marks = {tp: consumer.highwater(tp) for tp in partitions}
            # A fetch response's high-watermark is taken as it is parsed, and its first record
            # is returned by the same poll: once every mark is known, so is every head.
            if all(mark is not None for mark in marks.values()):
                return LogBounds({(tp.topic, tp.partition): int(mark)
                                  for tp, mark in marks.items()}, heads)
            if time.monotonic() > deadline:
                raise ServiceUnavailable(
                    f"Kafka at {bootstrap} reported no high-watermark for "
                    f"{sorted(str(tp) for tp, m in marks.items() if m is None)} in {timeout:.0f}s")
            for tp, batch in consumer.poll(timeout_ms=200, max_records=1).items():
                if batch and (tp.topic, tp.partition) not in heads:
                    heads[(tp.topic, tp.partition)] = (batch[0].offset, batch[0].timestamp)
                    consumer.pause(tp)  # its mark came with it; nothing more to fetch
    finally:
        consumer.close()


def high_watermarks(bootstrap: str, topics: list[str], client: dict[str, Any] | None = None
                    ) -> dict[tuple[str, int], int]:
    """The next offset of every partition of ``topics`` that exist (log_bounds' ends)."""
    return log_bounds(bootstrap, topics, client).ends


class KafkaRangeReader(DataSourceReader):
    def __init__(self, bootstrap: str, ranges: list[OffsetRange], stall_seconds: float,
                 client: dict[str, Any] | None = None, library: str = "kafka-python") -> None:
        self.bootstrap = bootstrap
        self.ranges = ranges
        self.stall_seconds = stall_seconds
        self.client = client or {}
        self.library = library

    def partitions(self) -> list[OffsetRange]:
        return self.ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Yield the range as Arrow batches; fail if the broker stops making progress."""
        assert isinstance(partition, OffsetRange)
        read = self._read_confluent if self.library == "confluent" else self._read_kafka_python
        with _collector_paused():
            yield from read(partition)

    def _read_kafka_python(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:
        tp = TopicPartition(partition.topic, partition.partition)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap.split(","),
                                 **{**_CONSUMER, **self.client})
        try:
            consumer.assign([tp])
            consumer.seek(tp, partition.start)
            stalled_since = time.monotonic()
            while consumer.position(tp) < partition.end:
                batch = consumer.poll(timeout_ms=500, max_records=50_000).get(tp, [])
                if batch:
                    stalled_since = time.monotonic()
                    kept = [m for m in batch if m.offset < partition.end]
                    yield _to_arrow(partition, [m.offset for m in kept],
                                    [m.headers for m in kept])
                elif time.monotonic() - stalled_since > self.stall_seconds:
                    raise TimeoutError(_stalled(partition, consumer.position(tp)))
        finally:
            consumer.close()

    def _read_confluent(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:
        from confluent_kafka import Consumer, Message
        from confluent_kafka import TopicPartition as RdTopicPartition

        consumer = Consumer({**_RDKAFKA, "bootstrap.servers": self.bootstrap, **self.client})
        try:
            consumer.assign([RdTopicPartition(partition.topic, partition.partition,
                                              partition.start)])
            position = partition.start
            stalled_since = time.monotonic()
            while position < partition.end:
                # Per record only C calls (map over Message's methods): this loop runs for
                # every record of the window, and Python-level work per record dominated it.
                batch = consumer.consume(num_messages=50_000, timeout=0.5)
                reached = -1  # where the fetch found the partition's end, if it did
                if any(map(Message.error, batch)):
                    batch, reached = _records_and_end(batch)
                # a record (not an error) always has its offset
                offsets = cast(list[int], list(map(Message.offset, batch)))
                kept = bisect.bisect_left(offsets, partition.end)  # ascending in a partition
                if kept:
                    yield _to_arrow(partition, offsets[:kept],
                                    list(map(Message.headers, batch[:kept])))
                if kept < len(offsets) or reached >= partition.end:
                    return  # past the end (offsets before it gone: compaction), or only markers
                if offsets or reached > position:
                    stalled_since = time.monotonic()
                    position = max(offsets[-1] + 1 if offsets else -1, reached)
                elif time.monotonic() - stalled_since > self.stall_seconds:
                    raise TimeoutError(_stalled(partition, position))
        finally:
            consumer.close()


def _records_and_end(batch: list[Any]) -> tuple[list[Any], int]:
    """A librdkafka batch's records, and the offset the fetch reached the partition's end
    at (-1 if it did not); any other error raised."""
    from confluent_kafka import KafkaError, KafkaException

    records, reached = [], -1
    for message in batch:
        error = message.error()
        if error is None:
            records.append(message)
        elif error.code() == KafkaError._PARTITION_EOF:
            reached = message.offset()
        else:
            raise KafkaException(error)
    return records, reached


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while records stream through: each batch of tens
    of thousands of records (none in a cycle) set off collections that took half the read's
    time (profiled with py-spy)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stalled(partition: OffsetRange, position: int) -> str:
    return (f"reading {partition.topic}[{partition.partition}] stalled at offset {position} "
            f"before {partition.end}")


def _to_arrow(partition: OffsetRange, offsets: list[int],
              headers: list[Any]) -> pa.RecordBatch:
    """The records' positions and outbox-ids (headers as (name, bytes) pairs, or None)."""
    ids: list[int | None] = []
    for record_headers in headers:
        found = None
        for name, value in record_headers or ():
            if name == ID_HEADER:
                found = header_message_id(value)
                break
        ids.append(found)
    n = len(offsets)
    return pa.RecordBatch.from_arrays([
        pa.array([partition.topic] * n, pa.string()),
        pa.array([partition.partition] * n, pa.int32()),
        pa.array(offsets, pa.int64()),
        pa.array(ids, pa.int64()),
    ], schema=SCHEMA)


class KafkaRangeSource(DataSource):
    """``spark.read.format("outbox_kafka")`` with options ``bootstrap`` and ``ranges``.

    ``ranges`` is JSON: ``[[topic, partition, start, end], ...]``; ``max_records_per_split``
    (default 1,000,000) cuts long ranges; ``stall_seconds`` (default 120) bounds a stall;
    ``library`` is ``kafka-python`` (default) or ``confluent``; ``client`` (JSON) adds that
    client's settings, and the SASL password (``sasl_plain_password`` or ``sasl.password``)
    travels as its own option so Spark redacts it from plans and logs.
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SPARK_SCHEMA

    def reader(self, schema: Any) -> KafkaRangeReader:
        ranges = [OffsetRange(t, int(p), int(s), int(e))
                  for t, p, s, e in json.loads(self.options["ranges"])]
        per_split = int(self.options.get("max_records_per_split", 1_000_000))
        client = json.loads(self.options.get("client", "{}"))
        library = self.options.get("library", "kafka-python")
        if library not in CLIENTS:
            raise ValueError(f"library must be one of {', '.join(CLIENTS)}, not {library!r}")
        password = PASSWORD_OPTION[library]
        if password in self.options:
            client[password] = self.options[password]
        return KafkaRangeReader(self.options["bootstrap"], split(ranges, per_split),
                                float(self.options.get("stall_seconds", 120)), client, library)
