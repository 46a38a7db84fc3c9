"""One PostgreSQL server and one broker per test session; a schema and a topic per test."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url


@pytest.fixture(scope="session")
def services() -> Iterator[devservices.Services]:
    started = devservices.start()
    yield started
    devservices.stop(started)


@pytest.fixture(scope="session")
def engine(services: devservices.Services) -> Iterator[Engine]:
    eng = create_engine(sqlalchemy_url(services.database_url), pool_size=10)
    yield eng
    eng.dispose()


@pytest.fixture
def schema(services: devservices.Services, engine: Engine) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name)
    yield name
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {name} CASCADE"))


@pytest.fixture
def topic(services: devservices.Services) -> str:
    name = f"orders-{uuid.uuid4().hex[:10]}"
    create_topic(services.kafka_bootstrap, name, partitions=3)
    return name


#: The relay's transports (OUTBOX_KAFKA_CLIENT). A module whose tests must hold with each sets
#: ``pytestmark = both_transports``; elsewhere the default, kafka-python, is used.
TRANSPORTS = ("kafka-python", "confluent")
both_transports = pytest.mark.parametrize("kafka_client", TRANSPORTS)


@pytest.fixture
def kafka_client() -> str:
    return "kafka-python"


@pytest.fixture
def settings(services: devservices.Services, schema: str, kafka_client: str) -> Settings:
    return Settings(
        database_url=services.database_url,
        kafka_bootstrap=services.kafka_bootstrap,
        kafka_client=kafka_client,
        schema_name=schema,
        relay_poll_interval=0.5,
        relay_lease_seconds=3,
        relay_batch_size=200,
    )


@pytest.fixture
def outbox(settings: Settings) -> Outbox:
    return Outbox(settings=settings)


class Daemon(Protocol):
    def run(self) -> None: ...
    def stop(self) -> None: ...


D = TypeVar("D", bound=Daemon)


@contextlib.contextmanager
def running(daemon: D, name: str) -> Iterator[D]:
    """A relay or sweeper running in a thread until the block ends; its crash fails the test."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            daemon.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive(), f"{name} did not stop within 30 s"
    assert not failure, f"{name} crashed: {failure[0]!r}"


@contextlib.contextmanager
def running_relay(settings: Settings) -> Iterator[Relay]:
    with running(Relay(settings), "relay") as daemon:
        yield daemon


@pytest.fixture
def relay(settings: Settings) -> Iterator[Relay]:
    """A relay running in a thread for the duration of the test."""
    with running_relay(settings) as daemon:
        yield daemon


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "condition"
               ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def count_status(engine: Engine, schema: str, status: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            text(f"SELECT count(*) FROM {schema}.message WHERE status = :s"), {"s": status}
        ).scalar_one())


def wait_delivered(engine: Engine, schema: str, expected: int, timeout: float = 60) -> None:
    wait_until(lambda: count_status(engine, schema, "DELIVERED") >= expected, timeout,
               f"{expected} messages delivered")


def publish_orders(engine: Engine, outbox: Outbox, topic: str, orders: list[tuple[str, int]],
                   *, commit: bool = True) -> list[int]:
    """Publish (key, order number) messages in one transaction; returns their ids."""
    with Session(engine) as session:
        session.begin()
        ids = [outbox.publish(session, topic, {"order": n}, key=key) for key, n in orders]
        if commit:
            session.commit()
        else:
            session.rollback()
    return ids
