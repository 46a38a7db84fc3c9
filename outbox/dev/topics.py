"""Creating a topic and reading it whole up to its high-watermark, for the demo, tests and
benchmarks (reconciliation reads topics with its own Spark data source, spark/kafka_source.py).

The high-watermark is taken from fetch responses rather than ListOffsets, which some
Kafka-compatible brokers answer wrongly; this works against Apache Kafka as well. For the
same reason a read starts at offset 0, not at ListOffsets "earliest" (relay/tails.py says
how the embedded broker answers it), and the consumer's reset takes it to the log's start
where retention took offset 0.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from outbox.encoding import ID_HEADER


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]

    @property
    def message_id(self) -> int | None:
        raw = self.headers.get(ID_HEADER)
        return int(raw) if raw is not None else None


def create_topic(bootstrap: str, topic: str, partitions: int = 3,
                 client: dict[str, Any] | None = None) -> None:
    """``client``: extra kafka-python settings (SASL/TLS, ``Settings.kafka_security()``)."""
    create_topics(bootstrap, [topic], partitions, client)


def create_topics(bootstrap: str, topics: list[str], partitions: int = 3,
                  client: dict[str, Any] | None = None) -> None:
    """Many topics on one admin client, 500 a request (the benchmarks' thousands)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), **(client or {}))
    try:
        for i in range(0, len(topics), 500):
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics([NewTopic(t, partitions, 1) for t in topics[i:i + 500]])
    finally:
        admin.close()


def read_topic(bootstrap: str, topic: str, timeout: float = 30.0,
               client: dict[str, Any] | None = None) -> list[Record]:
    """Every record of ``topic``, partition by partition in offset order."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap.split(","),
        enable_auto_commit=False,
        group_id=None,
        auto_offset_reset="earliest",
        consumer_timeout_ms=500,
        **(client or {}),
    )
    try:
        partitions = _partitions(consumer, topic, timeout)
        consumer.assign(partitions)
        for partition in partitions:
            consumer.seek(partition, 0)
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200, max_records=10_000).values():
                records.extend(
                    Record(m.topic, m.partition, m.offset, m.key, m.value, dict(m.headers or ()))
                    for m in batch
                )
            highwater = {tp: consumer.highwater(tp) for tp in partitions}
            if all(hw is not None and consumer.position(tp) >= hw
                   for tp, hw in highwater.items()):
                break
        else:
            raise TimeoutError(f"could not read topic {topic} to its end within {timeout}s")
        return sorted(records, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


def _partitions(consumer: KafkaConsumer, topic: str, timeout: float) -> list[TopicPartition]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = consumer.partitions_for_topic(topic)
        if found:
            return [TopicPartition(topic, p) for p in sorted(found)]
        time.sleep(0.1)
    raise TimeoutError(f"topic {topic} not found within {timeout}s")
