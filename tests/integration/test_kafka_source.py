"""The reconciliation's Kafka reader on its own: ranges of real partitions read with each
client, where a partition holds more than records (transaction markers)."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaProducer

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.spark.kafka_source import KafkaRangeReader, OffsetRange, high_watermarks
from tests.conftest import TRANSPORTS


def _transactional(bootstrap: str, topic: str, batches: list[int]) -> None:
    """Each of ``batches`` records, in a transaction of its own, committed: Kafka writes a
    commit marker after each, an offset no consumer is given as a record."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=uuid.uuid4().hex,
                             enable_idempotence=True, acks="all")
    try:
        producer.init_transactions()
        number = 0
        for size in batches:
            producer.begin_transaction()
            for _ in range(size):
                producer.send(topic, key=b"k", value=b"v", partition=0,
                              headers=[("outbox-id", str(number).encode())])
                number += 1
            producer.commit_transaction()
    finally:
        producer.close()


@pytest.mark.parametrize("client", TRANSPORTS)
def test_a_range_ending_in_transaction_markers_is_read_to_its_end(
    services: devservices.Services, client: str
) -> None:
    """Three transactions of 3, 2 and 1 records: 6 records and 3 markers, the last offset
    of the partition a marker. Every piece of 2 offsets (some of markers only) is read to its
    end; before, librdkafka's reader waited for a record at the marker's offset and failed
    at its stall limit."""
    bootstrap = services.kafka_bootstrap
    topic = f"txn-{uuid.uuid4().hex[:10]}"
    create_topic(bootstrap, topic, partitions=1)
    _transactional(bootstrap, topic, [3, 2, 1])
    end = high_watermarks(bootstrap, [topic])[(topic, 0)]
    assert end == 9  # 6 records and 3 commit markers
    pieces = [OffsetRange(topic, 0, start, min(end, start + 2)) for start in range(0, end, 2)]
    reader = KafkaRangeReader(bootstrap, pieces, stall_seconds=5, library=client)
    read = [offset for piece in pieces for batch in reader.read(piece)
            for offset in batch.column("offset").to_pylist()]
    assert read == [0, 1, 2, 4, 5, 7]
