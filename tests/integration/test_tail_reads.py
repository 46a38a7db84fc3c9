"""A tail read (relay/tails.py, relay/confluent.py) ends at every partition's high-watermark,
records or not, and follows its partitions without asking Kafka where each one is on every
turn."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay import tails
from outbox.relay.tails import make_tail_reader
from outbox.settings import Settings
from tests.conftest import both_transports


def produce(bootstrap: str, topic: str, partitions: range, *, first_id: int = 1,
            transactional: bool = False) -> None:
    """One record with an ``outbox-id`` header to each of ``partitions``."""
    extra = {"transactional_id": f"tails-{uuid.uuid4().hex[:8]}"} if transactional else {}
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), **extra)
    try:
        if transactional:
            producer.init_transactions()
            producer.begin_transaction()
        for n, partition in enumerate(partitions, start=first_id):
            producer.send(topic, b"v", key=b"k", partition=partition,
                          headers=[("outbox-id", b"%d" % n)])
        if transactional:
            producer.commit_transaction()
        producer.flush()
    finally:
        producer.close()


@both_transports
def test_a_tail_read_ends_at_a_transaction_marker_past_its_last_record(
    services: devservices.Services, settings: Settings
) -> None:
    """A committed transaction ends its partition with a marker no consumer is given: the
    partition's tail ends one past its last record. The read must still end there (it asks
    Kafka for the partition's position once nothing more comes), beside a partition of
    plain records and an empty one."""
    topic = f"tails-{uuid.uuid4().hex[:10]}"
    create_topic(services.kafka_bootstrap, topic, partitions=3)
    produce(services.kafka_bootstrap, topic, range(1), first_id=10)
    produce(services.kafka_bootstrap, topic, range(2, 3), transactional=True)
    produce(services.kafka_bootstrap, topic, range(2, 3), first_id=2, transactional=True)
    reader = make_tail_reader(settings)
    try:
        tail = reader.read(dict.fromkeys((topic, p) for p in range(3)), 1_000)
    finally:
        reader.close()
    assert tail.complete
    assert tail.ids() == [1, 2, 10]
    assert set(tail.found.values()) == {(0, 0), (2, 0), (2, 2)}, \
        "the second transaction's record follows the first's marker"


def test_kafka_python_positions_are_asked_only_where_the_records_do_not_tell(
    services: devservices.Services, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kafka-python's ``position()`` walks every assigned partition. The read asked it of
    every partition on every turn until all were done, the square of the read's partitions:
    a read of 1,000 partitions got no record for 15 s and failed. Each partition's position
    is now followed from its records."""
    topic = f"tails-{uuid.uuid4().hex[:10]}"
    create_topic(services.kafka_bootstrap, topic, partitions=30)
    produce(services.kafka_bootstrap, topic, range(30))
    asked: list[Any] = []

    class Counted(KafkaConsumer):  # the real consumer, its position() calls counted
        def position(self, partition: Any, timeout_ms: Any = None) -> Any:
            asked.append(partition)
            return super().position(partition, timeout_ms)

    monkeypatch.setattr(tails, "KafkaConsumer", Counted)
    reader = make_tail_reader(settings)
    try:
        tail = reader.read(dict.fromkeys((topic, p) for p in range(30)), 1_000)
    finally:
        reader.close()
    assert tail.ids() == list(range(1, 31))
    assert asked == [], "each partition's end is told by its record"
