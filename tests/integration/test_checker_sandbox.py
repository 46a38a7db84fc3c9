"""A SQL checker cannot escape its check (issue 11, §1): it is one statement, PostgreSQL
refuses a second; it runs as the checker role, read-only and under the checker timeout,
whatever it contains, and leaves nothing on its connection. One it cannot run is refused
when the sweeper starts, in one line, before any message is checked."""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text

from outbox import Outbox
from outbox.dev import services as devservices
from outbox.settings import Settings
from tests.conftest import wait_until
from tests.integration import test_sweeper
from tests.integration.test_sweeper import (
    GROUP,
    advisory_locks,
    ops,
    prepare,
    row,
    sweeping,
    wait_resolution,
    wait_status,
)
from tests.processes import start_outbox
from tests.tcp_proxy import TcpProxy

fast = test_sweeper.fast
orders = test_sweeper.orders


def payment_states(engine: Engine, payments: str) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT * FROM {payments} ORDER BY 1"))]


def sweep_refused(settings: Settings, sql: str) -> str:
    """Start `outbox sweep` with ``sql`` as the checker of GROUP: its one error line."""
    sweeper = start_outbox(settings, "sweep", "--check-interval", "0.1",
                           OUTBOX_SQL_CHECKERS=json.dumps({GROUP: sql}))
    try:
        output, _ = sweeper.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        sweeper.kill()
        output, _ = sweeper.communicate()
        pytest.fail(f"the sweeper started with the checker {sql!r}:\n{output}")
    lines = output.strip().splitlines()
    assert sweeper.returncode == 2, output
    assert len(lines) == 1 and lines[0].startswith("outbox: error: "), output
    return lines[0]


ESCAPES = {
    "commit-then-delete": ("SELECT 'UNKNOWN'; COMMIT; DELETE FROM {payments} WHERE order_id = 1",
                           "cannot insert multiple commands"),
    "rollback-begin-delete-commit": (
        "ROLLBACK; BEGIN; DELETE FROM {payments} WHERE order_id = 1; COMMIT; SELECT 'UNKNOWN'",
        "cannot insert multiple commands"),
    "commit-then-update": ("SELECT 'UNKNOWN'; COMMIT; UPDATE {payments} SET state = 'paid'",
                           "cannot insert multiple commands"),
    "commit-then-sleep-past-the-timeout": ("SELECT 'UNKNOWN'; COMMIT; SELECT pg_sleep(15)",
                                           "cannot insert multiple commands"),
    "set-transaction-read-write": ("SET TRANSACTION READ WRITE", "returns no column"),
    "set-statement-timeout": ("SET statement_timeout = 0", "returns no column"),
    "do-block": ("DO $$BEGIN DELETE FROM {payments}; END$$", "returns no column"),
    "copy-to-program-as-superuser": ("COPY (SELECT 1) TO PROGRAM 'touch {file}'",
                                     "returns no column"),
    "writes-outbox-tables": (
        "UPDATE {schema}.pending SET status = 'PARKED' RETURNING 'COMMIT'",
        "permission denied for schema"),
    "reads-outbox-payloads": ("SELECT 'COMMIT' FROM {schema}.message WHERE payload IS NOT NULL",
                              "permission denied for schema"),
    "does-not-parse": ("SELEC 'COMMIT'", "syntax error"),
    "binds-an-unknown-name": ("SELECT 'COMMIT' FROM {payments} WHERE order_id = :order_id",
                              "binds :order_id; a SQL checker may bind :id"),
    "names-an-unknown-column": ("SELECT nope FROM {payments}", 'column "nope" does not exist'),
    # Preparing a statement checks no table privilege: these failed at every check instead.
    "reads-a-table-not-granted": ("SELECT 'COMMIT' FROM pg_authid",
                                  "permission denied for table pg_authid (it runs as the role"),
    "locks-rows": ("SELECT 'COMMIT' FROM {payments} WHERE order_id = :id FOR UPDATE",
                   "permission denied for table payments"),
}


@pytest.mark.parametrize(("sql", "error"), ESCAPES.values(), ids=ESCAPES.keys())
def test_a_checker_that_could_escape_or_cannot_run_is_refused_at_start_and_changes_nothing(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str, sql: str,
    error: str,
) -> None:
    message_id = prepare(engine, orders)
    before = payment_states(engine, payments)
    shell_ran = Path(tempfile.gettempdir()) / f"{schema}-shell-ran"  # the server may write here
    started = time.monotonic()
    line = sweep_refused(fast, sql.format(payments=payments, schema=schema, file=shell_ran))
    assert f"the SQL checker of producer group '{GROUP}'" in line and error in line, line
    assert time.monotonic() - started < 10
    assert payment_states(engine, payments) == before
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "PENDING", 0)
    assert not shell_ran.exists()


@pytest.mark.parametrize("sql", [
    "SELECT 'COMMIT' FROM {payments} WHERE order_id = :id FOR UPDATE",
    "SELECT 'COMMIT' FROM {payments} WHERE order_id = :id FOR KEY SHARE",
    "WITH gone AS (DELETE FROM {payments} RETURNING 1) SELECT 'ROLLBACK' FROM gone",
], ids=["for-update", "for-key-share", "deletes"])
def test_a_checker_that_would_lock_or_write_rows_is_refused_at_start_though_its_role_may(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str, sql: str
) -> None:
    """Its role granted UPDATE and DELETE, the statement prepared, and every check then
    failed on its read-only transaction: `checker raised InternalError`, 15 times a message."""
    with engine.begin() as conn:
        conn.execute(text(f"GRANT UPDATE, DELETE ON {payments} TO {schema}_checker"))
    message_id = prepare(engine, orders)
    line = sweep_refused(fast, sql.format(payments=payments))
    assert "it would lock or write rows" in line and "a check runs read-only" in line, line
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "PENDING", 0)
    assert len(payment_states(engine, payments)) == 3


def test_sql_checkers_without_the_checker_role_are_refused_at_start(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    message_id = prepare(engine, orders)
    line = sweep_refused(fast, "SELECT 'COMMIT'")
    assert f"role {schema}_checker, which is missing" in line
    assert "outbox db upgrade --create-roles" in line
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "PENDING", 0)


def refused_at_check(engine: Engine, orders: Outbox, fast: Settings, schema: str, sql: str,
                     **overrides: float) -> str:
    """Run ``sql`` as the checker of one message, once: the op record that discarded it."""
    message_id = prepare(engine, orders)
    with sweeping(fast, sql_checkers={GROUP: sql}, check_max=1, **overrides):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=15)
    [(_, detail)] = ops(engine, schema, message_id)
    return detail


def test_a_checker_runs_as_the_checker_role_not_as_the_sweepers_superuser(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    message_id = prepare(engine, orders)
    sql = (f"SELECT CASE WHEN current_user = '{schema}_checker' AND NOT rolsuper "
           f"THEN 'ROLLBACK' ELSE 'COMMIT' END FROM pg_roles WHERE rolname = current_user")
    with sweeping(fast, sql_checkers={GROUP: sql}):
        wait_status(engine, schema, message_id, "ROLLED_BACK", timeout=15)


def test_a_checker_cannot_take_back_the_sweepers_role(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "outbox.sweeper")
    detail = refused_at_check(
        engine, orders, fast, schema,
        "SELECT CASE WHEN set_config('role', 'none', true) IS NOT NULL THEN 'COMMIT' END")
    assert 'cannot set parameter "role" within security-definer function' in detail
    [line] = [r.getMessage() for r in caplog.records if "counted as inconclusive" in r.message]
    assert 'PostgreSQL refused: cannot set parameter "role"' in line


def test_a_checker_cannot_make_its_transaction_read_write(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    detail = refused_at_check(
        engine, orders, fast, schema,
        "SELECT CASE WHEN set_config('transaction_read_only', 'off', true) = 'off' "
        "THEN 'COMMIT' END")
    assert "read-write mode must be set before any query" in detail


def test_a_checker_cannot_lift_its_statement_timeout(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    started = time.monotonic()
    detail = refused_at_check(
        engine, orders, fast, schema,
        "SELECT 'COMMIT' FROM (SELECT set_config('statement_timeout', '0', true)) AS lifted, "
        "pg_sleep(15)")
    assert detail.endswith("checker timed out after 2 s")
    assert time.monotonic() - started < 10


def test_a_checker_leaves_no_advisory_lock_on_the_pooled_connection(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    message_id = prepare(engine, orders)
    sql = "SELECT 'UNKNOWN' FROM pg_advisory_lock(4242)"
    with sweeping(fast, sql_checkers={GROUP: sql}, check_max=1):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=15)
        held = advisory_locks(engine, 4242)
    assert held == 0


def test_a_checker_cannot_call_functions_the_sweepers_superuser_may(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str],
    services_url: str,
) -> None:
    with psycopg.connect(services_url) as bystander:
        pid = bystander.info.backend_pid
        detail = refused_at_check(engine, orders, fast, schema,
                                  f"SELECT CAST(pg_terminate_backend({pid}) AS text)")
        assert "must be a superuser to terminate superuser process" in detail
        assert bystander.execute("SELECT 1").fetchone() == (1,)


@pytest.fixture
def services_url(fast: Settings) -> str:
    return fast.database_url


def test_a_binary_key_and_payload_reach_a_sql_checker_as_text(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    """A NUL byte in a key or payload (protobuf, an integer or UUID as key bytes) made every
    check of the message "PostgreSQL refused: ... cannot contain NUL (0x00) bytes", and the
    message was discarded after 15, whatever the checker would have answered. They reach it
    as text, NUL and invalid UTF-8 replaced by U+FFFD."""
    message_id = prepare(engine, orders, payload=b"\x00\xff{}", key=b"\x00\x2a")
    sql = ("SELECT CASE WHEN :key = U&'\\FFFD*' AND :payload = U&'\\FFFD\\FFFD{}' "
           "THEN 'COMMIT' ELSE 'ROLLBACK' END")
    with sweeping(fast, sql_checkers={GROUP: sql}):
        wait_resolution(engine, schema, message_id, "COMMIT", timeout=15)
    assert row(engine, schema, message_id).check_count == 1


def test_a_connection_lost_while_a_sql_checker_is_prepared_is_not_the_message_s_fault(
    services: devservices.Services, engine: Engine, orders: Outbox, fast: Settings,
    schema: str, roles: list[str], caplog: pytest.LogCaptureFixture,
) -> None:
    """The checker's statement was prepared and described by libpq's blocking calls, and
    psycopg's describe holds the interpreter lock through its round trip: through a
    forwarder in the same process (this proxy) the sweeper froze at start, every thread of
    the process with it. A connection lost at the prepare is the server's trouble: the
    check counts nothing (15 inconclusive checks discard a message)."""
    caplog.set_level(logging.INFO, "outbox.sweeper")
    proxy = TcpProxy(make_url(services.database_url).port or 5432)
    through = fast.model_copy(update={"database_url": make_url(services.database_url).set(
        port=proxy.port).render_as_string(hide_password=False)})
    sql = "SELECT 'COMMIT' /* lost here */"
    try:
        with sweeping(through, sql_checkers={GROUP: sql}):
            wait_until(lambda: "started" in caplog.text, 15, "the sweeper's own check of it")
            proxy.trap(b"lost here")
            message_id = prepare(engine, orders)
            wait_until(proxy.sprung.is_set, 15, "the connection to be lost at the prepare")
            wait_until(lambda: row(engine, schema, message_id).resolution == "COMMIT", 30,
                       "the next check's answer")
    finally:
        proxy.close()
    assert "inconclusive" not in caplog.text and "refused" not in caplog.text, caplog.text
