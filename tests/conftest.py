"""One PostgreSQL server and one broker per test session; a schema and a topic per test.

The migrations run once per session, rendered as SQL (Alembic offline) for a placeholder
schema; each test's schema is a copy of that script with its own name, which costs a few
milliseconds instead of an Alembic run. tests/integration/test_migrations.py runs Alembic
online and proves the copy and the real thing are the same.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest
from alembic import command
from sqlalchemy import Engine, NullPool, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, store
from outbox.dev import services as devservices
from outbox.dev.topics import Record, create_topic, read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url

#: Spark's settings for every session the suite starts, in process or in a subprocess.
os.environ.setdefault("SPARK_CONF_DIR", str(Path(__file__).with_name("spark-conf")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a slow test (20 s or more) first, then the others by how many
    tests they hold, most first; each file's tests in their own order. ``make test`` hands
    its workers whole files in this order (``--no-loadscope-reorder``): by its own order,
    by count alone, the files of one long test (a Spark cluster, the soak) came last, and one
    worker ran them while the other idled. A worker takes a new file when two of its tests
    are left, so a long test near the end holds its worker while the other runs dry: with
    only the Spark cluster, the soak and three more marked, the demo and the chaos run came
    last, and one worker finished 45 s before the other (session 34's timeline)."""
    slow: dict[Path, bool] = {}
    count: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, False) or bool(item.get_closest_marker("slow"))
        count[item.path] = count.get(item.path, 0) + 1
    items.sort(key=lambda item: (not slow[item.path], -count[item.path]))


@pytest.fixture(scope="session")
def services() -> Iterator[devservices.Services]:
    started = devservices.start()
    yield started
    devservices.stop(started)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A disk of 64 KiB (tmpfs), to fill up for real."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.fixture(scope="session")
def engine(services: devservices.Services) -> Iterator[Engine]:
    # JIT off, as in the outbox's own processes (store.engine): a count over the
    # message_state view, which reads partitioned tables, otherwise compiles for a second.
    eng = store.engine(sqlalchemy_url(services.database_url), pool_size=10)
    yield eng
    eng.dispose()


#: The schema name the session's migration script is rendered for, replaced in each copy.
PLACEHOLDER = "outbox_schema_placeholder"


@pytest.fixture
def application(services: devservices.Services) -> Iterator[Engine]:
    """An application's own engine: none of the outbox's session settings, so PostgreSQL
    plans as it likes (generically from a statement's sixth run, when that looks cheaper)."""
    eng = create_engine(sqlalchemy_url(services.database_url), poolclass=NullPool)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def migration_script() -> str:
    """Every outbox revision up to head as one SQL script for PLACEHOLDER (no database)."""
    config = migrate.alembic_config("postgresql://offline/unused", PLACEHOLDER)
    config.output_buffer = io.StringIO()
    command.upgrade(config, "head", sql=True)
    script = config.output_buffer.getvalue().strip()
    assert script.startswith("BEGIN;") and script.endswith("COMMIT;"), script[:200]
    return script.removeprefix("BEGIN;").removesuffix("COMMIT;")


def copy_schema(engine: Engine, script: str, name: str) -> None:
    """A schema named ``name`` exactly as ``outbox db upgrade`` would leave it."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {name}")
        conn.exec_driver_sql(script.replace(PLACEHOLDER, name))


def drop_schema(engine: Engine, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))


@contextlib.contextmanager
def fresh_schema(engine: Engine, migration_script: str, prefix: str = "t") -> Iterator[str]:
    """A migrated outbox schema copied from the session's script, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    copy_schema(engine, migration_script, name)
    yield name
    drop_schema(engine, name)


@pytest.fixture
def schema(engine: Engine, migration_script: str) -> Iterator[str]:
    """A fresh, migrated outbox schema for this test alone."""
    with fresh_schema(engine, migration_script) as name:
        yield name


@pytest.fixture
def alembic_schema(services: devservices.Services, engine: Engine) -> Iterator[str]:
    """A fresh schema migrated by Alembic itself (online), for the tests of the migrations."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name)
    yield name
    drop_schema(engine, name)


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
        if failure:  # said also when the block failed: a wait timed out because of it
            raise AssertionError(f"{name} crashed: {failure[0]!r}") from failure[0]
    assert not thread.is_alive(), f"{name} did not stop within 30 s"


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
            text(f"SELECT count(*) FROM {schema}.message_state WHERE status = :s"), {"s": status}
        ).scalar_one())


def ids_with_status(engine: Engine, schema: str, status: str) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            f"SELECT id FROM {schema}.message_state WHERE status = :s ORDER BY id"),
            {"s": status}).scalars())


def wait_delivered(engine: Engine, schema: str, expected: int, timeout: float = 60) -> None:
    wait_until(lambda: count_status(engine, schema, "DELIVERED") >= expected, timeout,
               f"{expected} messages delivered")


def delivered_to(engine: Engine, schema: str, bootstrap: str, topic: str) -> dict[int, Record]:
    """The records of ``topic`` that ``schema``'s relays delivered, by message id: those at
    the partitions and offsets its op records hold, carrying the id those name. Tests of the
    example services share topics ("orders") and each schema numbers its messages from 1,
    so a message id alone may name another test's record."""
    with engine.connect() as conn:
        landed = {(partition, offset): message_id for message_id, partition, offset in
                  conn.execute(text(
                      f"SELECT o.message_id, o.kafka_partition, o.kafka_offset "
                      f"FROM {schema}.op_record AS o JOIN {schema}.message AS m "
                      f"ON m.id = o.message_id WHERE o.action = 'DELIVERED' AND m.topic = :t"),
                      {"t": topic})}
    return {r.message_id: r for r in read_topic(bootstrap, topic)
            if r.message_id is not None and landed.get((r.partition, r.offset)) == r.message_id}


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


@pytest.fixture
def small(engine: Engine, settings: Settings, schema: str) -> Settings:
    """Ranges of 10 ids (three made ahead) instead of the million the migration made."""
    use_ranges(engine, schema, 10, ahead=3)
    assert ranges(engine, schema) == ["message_p1", "message_p11", "message_p21"]
    return settings.model_copy(update={"partition_size": 10})


def use_ranges(engine: Engine, schema: str, size: int, ahead: int) -> None:
    """Replace the empty ranges the migration made with ``ahead`` ranges of ``size`` ids.

    The migration's empty first range (``p0``) goes too: left in place, a relay's own
    retention pass would drop it at a moment of its choosing, and a test's prune
    count would race it."""
    with engine.begin() as conn:
        for name in ranges(engine, schema):
            conn.execute(text(f"DROP TABLE {schema}.{name}, {schema}.op_record_{name[8:]}"))
        store.ensure_partitions(conn, schema, size, ahead=ahead)


def partition_options(engine: Engine, schema: str) -> dict[str, list[str] | None]:
    """Each partition of ``message`` and ``op_record`` and its storage parameters."""
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT c.relname, c.reloptions FROM pg_inherits AS h "
            "JOIN pg_class AS c ON c.oid = h.inhrelid "
            "WHERE h.inhparent IN (CAST(:m AS regclass), CAST(:o AS regclass))"),
            {"m": f"{schema}.message", "o": f"{schema}.op_record"}).all())


def ranges(engine: Engine, schema: str) -> list[str]:
    """The range partitions of ``message``, lowest first."""
    with engine.connect() as conn:
        return list(conn.execute(text(
            f"SELECT name FROM {schema}.partition_bounds('{schema}.message') "
            f"ORDER BY low NULLS FIRST")).scalars())



def assert_refused(url: str, statements: list[str], match: str = "permission denied") -> None:
    """Each statement, run by the login role of ``url``, fails with an error matching
    ``match`` (a missing privilege by default; a constraint or trigger otherwise)."""
    from sqlalchemy.exc import DBAPIError

    as_login = create_engine(sqlalchemy_url(url))
    try:
        for statement in statements:
            with as_login.connect() as conn, pytest.raises(DBAPIError, match=match):
                conn.execute(text(statement))
    finally:
        as_login.dispose()


@pytest.fixture
def roles(services: devservices.Services, engine: Engine, schema: str) -> Iterator[list[str]]:
    """The least-privilege roles of ``schema`` (``outbox db upgrade --create-roles``)."""
    names = migrate.create_roles(services.database_url, schema)
    yield names
    drop_roles(engine, names)


def drop_roles(engine: Engine, names: list[str]) -> None:
    with engine.begin() as conn:
        for role in names:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


@pytest.fixture
def payments(engine: Engine, schema: str, roles: list[str]) -> Iterator[str]:
    """A business table, in a schema of its own, that SQL checkers may read (granted to the
    checker role, as an operator would)."""
    shop = f"{schema}_shop"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {shop}"))
        conn.execute(text(f"CREATE TABLE {shop}.payments (order_id int PRIMARY KEY, "
                          f"state text NOT NULL)"))
        conn.execute(text(f"INSERT INTO {shop}.payments VALUES "
                          f"(1, 'paid'), (2, 'failed'), (3, 'pending')"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA {shop} TO {schema}_checker"))
        conn.execute(text(f"GRANT SELECT ON {shop}.payments TO {schema}_checker"))
    yield f"{shop}.payments"
    drop_schema(engine, shop)
