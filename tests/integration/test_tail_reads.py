"""A tail read (relay/tails.py, relay/confluent.py) starts at offset 0 where no offset is
recorded, ends at every partition's high-watermark, records or not, and follows its partitions
without asking Kafka where each one is on every turn. The dev helper ``read_topic`` reads a
topic whole the same way."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic, create_topics, read_topic
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


#: records of the batch written last; rounds tried to have it written last
BATCH, ROUNDS = 3_000, 80


@pytest.fixture(scope="module")
def first_batch_written_last(services: devservices.Services) -> tuple[str, int]:
    """A one-partition topic whose batch at offset 0 the broker stored after a later batch,
    and how many records it has (ids 1 to that count).

    The embedded broker answers ListOffsets "earliest" with the offset of the batch it
    stored first, not the lowest offset: two producers writing one partition (two relays of
    the same topic) can have the batch at offset 0 stored after the next one, and a read
    starting at "the beginning" then skipped the records below that (CI on 1424785: a
    message recorded DELIVERED at offset 0 was nowhere in the topic). Made here by sending a
    large batch and, a moment later, a one-record batch: the delay is tuned round by round
    until the large batch gets offset 0 and the small one is stored first."""
    bootstrap = services.kafka_bootstrap
    names = [f"tails-{uuid.uuid4().hex[:10]}" for _ in range(ROUNDS)]
    create_topics(bootstrap, names, partitions=1)
    large = KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=10_000,
                          batch_size=16_000_000, max_request_size=32_000_000)
    small = KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=0)
    probe = KafkaConsumer(bootstrap_servers=bootstrap.split(","))
    delay, answers = 0.005, []
    try:
        for topic in names:
            for n in range(1, BATCH + 1):
                large.send(topic, b"v" * 1000, key=b"k", partition=0,
                           headers=[("outbox-id", b"%d" % n)])
            flushing = threading.Thread(target=large.flush)
            flushing.start()
            time.sleep(delay)
            offset = small.send(topic, b"v", key=b"k", partition=0,
                                headers=[("outbox-id", b"%d" % (BATCH + 1))]).get(10).offset
            flushing.join()
            partition = TopicPartition(topic, 0)
            earliest = probe.beginning_offsets([partition])[partition]
            answers.append(earliest)
            if earliest != 0:
                return topic, BATCH + 1
            delay = delay * 1.3 if offset == 0 else delay / 1.2  # sent too soon: it came first
    finally:
        for client in (large, small, probe):
            client.close()
    raise AssertionError(f"the broker stored every batch at offset 0 first in {ROUNDS} rounds "
                         f"(last delay {delay * 1000:.1f} ms; earliest offsets {answers[-5:]})")


@both_transports
def test_a_partition_whose_first_batch_was_stored_last_is_read_from_offset_0(
    settings: Settings, first_batch_written_last: tuple[str, int]
) -> None:
    """A partition with no recorded offset is read from offset 0, not from where ListOffsets
    "earliest" says it begins. (Where retention took offset 0, the consumer's reset,
    "earliest", starts the read at the log's start; the embedded broker deletes nothing, so
    that is not shown here.)"""
    topic, count = first_batch_written_last
    reader = make_tail_reader(settings)
    try:
        tail = reader.read({(topic, 0): None}, 10_000)
    finally:
        reader.close()
    assert tail.complete
    assert tail.ids() == list(range(1, count + 1)), "every record below the one stored first"


def test_read_topic_reads_a_partition_whose_first_batch_was_stored_last(
    services: devservices.Services, first_batch_written_last: tuple[str, int]
) -> None:
    """The tests' and the demo's reader (outbox/dev/topics.py) the same way."""
    topic, count = first_batch_written_last
    records = read_topic(services.kafka_bootstrap, topic)
    assert [r.offset for r in records] == list(range(count))


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
