"""The outbox's processes behind PgBouncer: refused in transaction mode, at home in session
mode; applications publish through either."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine

from outbox import Outbox
from outbox.exceptions import ConfigurationError
from outbox.relay.relay import Relay
from outbox.relay.sweeper import Sweeper
from outbox.schema import Resolution
from outbox.settings import Settings
from tests.conftest import publish_orders, wait_delivered
from tests.integration.test_cli_errors import assert_one_line_error
from tests.pgbouncer import pgbouncer
from tests.processes import outbox_env, run_outbox, start_outbox


@pytest.fixture(scope="module")
def transaction_pool(services: object) -> Iterator[str]:
    with pgbouncer(services.database_url, "transaction") as url:  # type: ignore[attr-defined]
        yield url


@pytest.mark.parametrize("command", [["relay"], ["status"], ["db", "upgrade"]])
def test_a_pooler_in_transaction_mode_is_refused_in_one_line(
    settings: Settings, transaction_pool: str, command: list[str]
) -> None:
    """A relay there hung for good with its shards leased (its wake locks stayed on server
    sessions it no longer had), and the CLI's settings reached applications' transactions."""
    result = run_outbox(None, *command,
                        env=outbox_env(settings, OUTBOX_DATABASE_URL=transaction_pool))
    assert_one_line_error(result, f"outbox {' '.join(command)} needs PostgreSQL sessions of "
                          "its own", "pool_mode = transaction", "session mode")


@pytest.mark.parametrize("daemon", ["relay", "sweeper"])
def test_a_daemon_run_from_python_refuses_a_pooler_in_transaction_mode(
    settings: Settings, transaction_pool: str, daemon: str
) -> None:
    """api.md's "Running the daemons from Python" passes no CLI: such a relay hung for good."""
    pooled = settings.model_copy(update={"database_url": transaction_pool})
    made = Relay(pooled) if daemon == "relay" else Sweeper(
        pooled, {"shop": lambda message, conn: Resolution.COMMIT})
    failures: list[BaseException] = []

    def run() -> None:
        try:
            made.run()
        except BaseException as exc:  # any end is the answer looked for
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        made.stop(abandon=True)
    assert not thread.is_alive(), f"the {daemon} still runs 30 s after it started"
    assert len(failures) == 1 and isinstance(failures[0], ConfigurationError), failures
    assert f"{daemon} {settings.worker_id} needs PostgreSQL sessions of its own" in str(
        failures[0])


def test_applications_publish_through_a_pooler_in_transaction_mode(
    settings: Settings, engine: Engine, transaction_pool: str, topic: str
) -> None:
    """With the driver's server-side prepared statements off, as any application there needs."""
    outbox = Outbox(settings=settings)
    with psycopg.connect(transaction_pool, prepare_threshold=None) as conn:
        for i in range(20):  # more than psycopg's prepare threshold, on one connection
            with conn.transaction():
                outbox.publish(conn, topic, {"order": i}, key=f"k{i % 3}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql(
            f"SELECT count(*) FROM {settings.schema_name}.pending").scalar_one() == 20


def test_the_relay_and_the_cli_work_through_a_pooler_in_session_mode(
    settings: Settings, engine: Engine, services: object, topic: str
) -> None:
    with pgbouncer(services.database_url, "session") as url:  # type: ignore[attr-defined]
        status = run_outbox(None, "status", env=outbox_env(settings, OUTBOX_DATABASE_URL=url))
        assert status.returncode == 0, status.stderr
        relay = start_outbox(settings, "relay", OUTBOX_DATABASE_URL=url)
        try:
            publish_orders(engine, Outbox(settings=settings), topic,
                           [(f"k{i % 3}", i) for i in range(30)])
            wait_delivered(engine, settings.schema_name, 30)
        finally:
            relay.send_signal(signal.SIGTERM)
            output, _ = relay.communicate(timeout=30)
    assert relay.returncode == 0, output
