"""Both transports against the real broker: switching transports never moves a key to another
partition, so per-key order survives the switch (DESIGN §3.4)."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka.admin import KafkaAdminClient
from kafka.partitioner.default import DefaultPartitioner

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay.producer import KeyHashPartitioner
from outbox.relay.transport import Delivery, make_transport
from outbox.settings import Settings
from tests.conftest import TRANSPORTS
from tests.kafka_proxy import KafkaProxy


def partitions_of(settings: Settings, client: str, topic: str, keys: list[bytes]
                  ) -> dict[bytes, int]:
    transport = make_transport(settings.model_copy(update={"kafka_client": client}))
    try:
        sent: list[Delivery] = [transport.send(topic, key, b"{}", []) for key in keys]
        assert transport.wait(sent, 30)
    finally:
        transport.close(10)
    assert [d.error for d in sent if d.error] == []
    return {key: d.partition for key, d in zip(keys, sent, strict=True)}


def test_a_key_lands_on_the_same_partition_with_either_transport(
    services: devservices.Services, settings: Settings
) -> None:
    topic = f"keys-{uuid.uuid4().hex[:8]}"
    create_topic(services.kafka_bootstrap, topic, partitions=12)
    keys = [f"order-{n}".encode() for n in range(300)] + [uuid.uuid4().bytes for _ in range(50)]
    placed = {client: partitions_of(settings, client, topic, keys) for client in TRANSPORTS}
    assert len(set(placed["kafka-python"].values())) == 12, "keys spread over every partition"
    assert placed["confluent"] == placed["kafka-python"]


def test_the_relay_s_remembered_key_hashes_place_keys_as_kafka_python_s_partitioner(
    services: devservices.Services, settings: Settings
) -> None:
    """The memo of key hashes (also once it has been emptied) chooses what kafka-python's
    DefaultPartitioner chooses, over the real broker's metadata."""
    topic = f"keys-{uuid.uuid4().hex[:8]}"
    create_topic(services.kafka_bootstrap, topic, partitions=7)
    transport = make_transport(settings.model_copy(update={"kafka_client": "kafka-python"}))
    try:
        assert transport.available([topic], 10) == {topic}
        cluster = transport.producer._metadata  # type: ignore[attr-defined]
        keys = [f"order-{n}".encode() for n in range(200)] + [uuid.uuid4().bytes for _ in range(50)]
        remembered, default = KeyHashPartitioner(size=16), DefaultPartitioner()
        for _ in range(2):
            chosen = [remembered.partition(topic, k, k, b"", b"", cluster) for k in keys]
            assert chosen == [default.partition(topic, k, k, b"", b"", cluster) for k in keys]
        assert len(set(chosen)) == 7 and 0 < len(remembered.hashes) <= 16
    finally:
        transport.close(10)


def test_the_relay_s_remembered_partitions_follow_a_topic_made_again_with_more(
    services: devservices.Services, settings: Settings
) -> None:
    """The partitioner remembers each topic's sorted partitions until kafka-python's next
    metadata update: a topic deleted and made again with 5 partitions instead of 3 places
    its keys over 5, as kafka-python's own partitioner does."""
    topic = f"regrown-{uuid.uuid4().hex[:8]}"
    create_topic(services.kafka_bootstrap, topic, partitions=3)
    transport = make_transport(settings.model_copy(update={"kafka_client": "kafka-python"}))
    admin = KafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    try:
        producer = transport.producer  # type: ignore[attr-defined]
        remembered, cluster = producer.config["partitioner"], producer._metadata
        keys = [f"order-{n}".encode() for n in range(100)]
        assert str(producer) == (f"<KafkaProducer client_id={producer.config['client_id']} "
                                 "transactional_id=None>"), "its name, formatted once"

        def placed() -> list[int]:
            chosen = [remembered.partition(topic, k, k, b"", b"", cluster) for k in keys]
            assert chosen == [DefaultPartitioner().partition(topic, k, k, b"", b"", cluster)
                              for k in keys]
            return chosen

        assert set(producer.partitions_for(topic)) == {0, 1, 2}
        assert set(placed()) == {0, 1, 2}
        assert remembered.sorted == {topic: [0, 1, 2]}
        admin.delete_topics([topic])
        create_topic(services.kafka_bootstrap, topic, partitions=5)
        deadline = time.monotonic() + 30
        while len(cluster.partitions_for_topic(topic) or ()) != 5:
            assert time.monotonic() < deadline, "kafka-python never saw 5 partitions"
            cluster.request_update()
            producer._sender.wakeup()
            time.sleep(0.1)
        assert set(placed()) == {0, 1, 2, 3, 4}
        sent = [transport.send(topic, k, b"{}", []) for k in keys]
        assert transport.wait(sent, 30)
        assert [d.partition for d in sent] == placed()
    finally:
        admin.close()
        transport.close(10)


@pytest.mark.parametrize("client", TRANSPORTS)
def test_waiting_for_a_batch_gives_up_at_its_timeout_and_sees_it_land_later(
    services: devservices.Services, settings: Settings, client: str
) -> None:
    """The relay's one wait per batch (Transport.wait): while the broker is cut off it
    answers False at the timeout (0: at once), and True once every record has landed."""
    topic = f"wait-{uuid.uuid4().hex[:8]}"
    create_topic(services.kafka_bootstrap, topic, partitions=3)
    proxy = KafkaProxy(services.kafka_port)
    transport = make_transport(settings.model_copy(
        update={"kafka_client": client, "kafka_bootstrap": proxy.bootstrap}))
    try:
        assert transport.available([topic], 10) == {topic}
        proxy.cut()
        sent = [transport.send(topic, b"k%d" % n, b"{}", []) for n in range(20)]
        assert not transport.wait(sent, 0)
        assert not transport.wait(sent, 0.5)
        assert [d.error for d in sent] == [None] * 20, "retriable: not failed, waiting"
        proxy.restore()
        assert transport.wait(sent, 30)
        assert [d.error for d in sent] == [None] * 20
        assert sorted(d.offset for d in sent if d.partition == sent[0].partition)[0] == 0
    finally:
        transport.close(10)
        proxy.close()
