"""Services of one test's own, the broker behind a proxy the test can cut."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Engine, create_engine

from outbox import Outbox, migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.settings import PARTITION_SIZE, Settings, sqlalchemy_url
from tests.tcp_proxy import TcpProxy


@dataclass
class Isolated:
    services: devservices.Services
    proxy: TcpProxy
    engine: Engine
    settings: Settings
    outbox: Outbox
    topic: str


@contextlib.contextmanager
def isolated_services(partitions: int = 3, kafka_client: str = "kafka-python",
                      partition_size: int = PARTITION_SIZE) -> Iterator[Isolated]:
    """``partitions``: the topic's; ``partition_size``: message ids per history partition."""
    proxy_port = devservices.free_port()
    services = devservices.start(kafka_advertised_port=proxy_port)
    proxy = TcpProxy(services.kafka_port, proxy_port)
    engine = create_engine(sqlalchemy_url(services.database_url), pool_pre_ping=True)
    try:
        migrate.upgrade(services.database_url, "outbox", partition_size=partition_size)
        topic = f"faults-{uuid.uuid4().hex[:6]}"
        create_topic(services.kafka_bootstrap, topic, partitions=partitions)
        settings = Settings(database_url=services.database_url,
                            kafka_bootstrap=services.kafka_bootstrap, relay_lease_seconds=3,
                            kafka_client=kafka_client,
                            relay_poll_interval=0.2)
        yield Isolated(services, proxy, engine, settings, Outbox(settings=settings), topic)
    finally:
        engine.dispose()
        proxy.close()
        devservices.stop(services)
