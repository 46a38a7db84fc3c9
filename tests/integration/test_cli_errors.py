"""Misconfiguration gets one actionable line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox import migrate
from outbox.dev import services as devservices
from outbox.exceptions import LOCK_WAIT_SECONDS
from outbox.settings import Settings
from tests.blackhole import mute_server
from tests.conftest import both_transports, wait_until
from tests.processes import outbox_env, run_outbox, start_outbox


def assert_one_line_error(result: object, *fragments: str) -> None:
    stderr = result.stderr.strip()  # type: ignore[attr-defined]
    assert result.returncode == 2, stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1, stderr
    for fragment in fragments:
        assert fragment in stderr


def test_relay_without_a_database_url() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = run_outbox(None, "relay", env=env)
    assert_one_line_error(result, "database_url is not set", "OUTBOX_DATABASE_URL")


#: The long-running commands; a reconciliation checks what it needs before Spark starts, so
#: its one line is all it prints too.
COMMANDS = pytest.mark.parametrize("command", [["relay"], ["reconcile", "--read-topics"]])


@COMMANDS
def test_against_an_unmigrated_schema(settings: Settings, command: list[str]) -> None:
    absent = f"absent_{uuid.uuid4().hex[:6]}"
    result = run_outbox(None, *command, env=outbox_env(settings, OUTBOX_SCHEMA=absent))
    # the command that migrates this schema, not the default one
    assert_one_line_error(result, "is not migrated", f"`outbox --schema {absent} db upgrade`")


def test_the_short_commands_refuse_a_schema_behind_the_code(settings: Settings, engine: Engine
                                                            ) -> None:
    """Against a schema at 0010, discarded and resume --all said there was nothing to do
    (exit 0), prune that a function was missing; status already refused it."""
    older = f"older_{uuid.uuid4().hex[:6]}"
    migrate.upgrade(settings.database_url, older, "0010")
    try:
        env = outbox_env(settings, OUTBOX_SCHEMA=older)
        for command in (["status"], ["discarded"], ["resume", "--all"], ["resume", "1"],
                        ["prune"]):
            assert_one_line_error(run_outbox(None, *command, env=env),
                                  f"outbox schema '{older}' is at revision 0010, not "
                                  f"{migrate.head()}: run `outbox --schema {older} db upgrade`")
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {older} CASCADE"))


@COMMANDS
def test_wrong_database_address_masks_the_password(settings: Settings, command: list[str]
                                                   ) -> None:
    port = devservices.free_port()
    env = outbox_env(settings, OUTBOX_DATABASE_URL=f"postgresql://app:s3cret@127.0.0.1:{port}/x")
    result = run_outbox(None, *command, env=env)
    assert_one_line_error(result, "cannot use PostgreSQL at postgresql://app:***@127.0.0.1")
    assert "s3cret" not in result.stderr


@COMMANDS
def test_wrong_broker_address(settings: Settings, command: list[str]) -> None:
    """One line after the connect timeout; a reconciliation says it before Spark starts. It
    asks first whether a broker runs there (it named the settings alone, as if the address
    could only be wrong, not the broker down)."""
    env = outbox_env(settings, OUTBOX_KAFKA_BOOTSTRAP=f"127.0.0.1:{devservices.free_port()}",
                     OUTBOX_KAFKA_CONNECT_TIMEOUT_MS="2000")
    result = run_outbox(None, *command, env=env)
    assert_one_line_error(result, "no Kafka broker answers at 127.0.0.1:",
                          ": is one running there? check OUTBOX_KAFKA_BOOTSTRAP")


@pytest.mark.parametrize(("window", "said"), [
    (["--since", "2026-11-02T00:00:00Z", "--until", "2026-11-01T00:00:00Z"], "is not before"),
    (["--since", "2999-01-01T00:00:00Z"], "is after the database's clock"),
])
def test_a_reconciliation_window_that_cannot_be_is_refused_before_spark_starts(
    settings: Settings, window: list[str], said: str
) -> None:
    """It was refused only once Spark had started, printing its own lines (10 s or more)."""
    result = run_outbox(settings, "reconcile", *window)
    assert_one_line_error(result, said)


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("OUTBOX_SCHEMA", "Robert'); DROP TABLE x;--", "invalid schema name"),
        ("OUTBOX_RELAY_BATCH_SIZE", "0", "OUTBOX_RELAY_BATCH_SIZE: Input should be greater"),
        ("OUTBOX_DATABASE_URL", "mysql://u@h/db", "database URL must be postgresql://"),
        ("OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS", "999", "OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS: "),
    ],
)
def test_invalid_settings(settings: Settings, variable: str, value: str, fragment: str) -> None:
    result = run_outbox(None, "relay", env=outbox_env(settings, **{variable: value}))
    assert_one_line_error(result, fragment)


@COMMANDS
def test_a_tls_file_that_is_missing_is_named_at_once(settings: Settings, command: list[str]
                                                     ) -> None:
    """The clients waited the whole connect timeout for the broker, then said none answers;
    a relay said so only once PostgreSQL had answered (here it cannot: nothing listens)."""
    env = outbox_env(settings, OUTBOX_KAFKA_SECURITY_PROTOCOL="SSL",
                     OUTBOX_DATABASE_URL=f"postgresql://app:pw@127.0.0.1:{devservices.free_port()}/x",
                     OUTBOX_KAFKA_SSL_CAFILE="/nonexistent/ca.pem",
                     OUTBOX_KAFKA_CONNECT_TIMEOUT_MS="60000")
    result = run_outbox(None, *command, env=env)
    assert_one_line_error(result, "kafka_ssl_cafile '/nonexistent/ca.pem' "
                                  "(OUTBOX_KAFKA_SSL_CAFILE): no such file")


@pytest.mark.parametrize("command", [["resume", "1"], ["discarded"], ["prune"]])
def test_a_schema_never_migrated_is_named_in_the_command_that_migrates_it(
    settings: Settings, command: list[str]
) -> None:
    """The line said `outbox db upgrade`, which migrates the default schema, not this one."""
    schema = f"never_{uuid.uuid4().hex[:8]}"
    result = run_outbox(None, "--schema", schema, *command, env=outbox_env(settings))
    assert_one_line_error(result, f"outbox schema '{schema}' is not migrated: run `outbox "
                                  f"--schema {schema} db upgrade` first")


@pytest.mark.parametrize("command", [["db", "upgrade", "--revision"], ["db", "downgrade"]])
@pytest.mark.parametrize("revision", ["", " "])
def test_an_empty_revision_is_one_line(settings: Settings, command: list[str], revision: str
                                       ) -> None:
    """It ended in a traceback of 87 lines (an AssertionError deep in Alembic)."""
    result = run_outbox(None, *command, revision, env=outbox_env(settings))
    assert_one_line_error(result, f"revision {revision!r} names none")


@both_transports
def test_tls_against_a_plaintext_listener_is_one_line_within_the_connect_timeout(
    settings: Settings
) -> None:
    """kafka-python waited for the listener's half of the handshake for good (14 minutes,
    SIGTERM and SIGINT only logged), where librdkafka gave up at its connect timeout."""
    env = outbox_env(settings, OUTBOX_KAFKA_SECURITY_PROTOCOL="SSL",
                     OUTBOX_KAFKA_CONNECT_TIMEOUT_MS="3000")
    result = run_outbox(None, "relay", env=env)  # a hang fails at run_outbox's 120 s
    assert_one_line_error(result, f"no Kafka broker answers at {settings.kafka_bootstrap} "
                                  "over SSL", "OUTBOX_KAFKA_SECURITY_PROTOCOL")


@pytest.mark.parametrize("command", [["relay"], ["status"], ["resume", "1"], ["db", "upgrade"]])
@pytest.mark.parametrize(("query", "fragment"), [
    ("sslmod=require", 'invalid connection option "sslmod"'),
    ("connect_timeout=soon", "bad value for connect_timeout: 'soon'"),
], ids=["misspelt-option", "bad-timeout"])
def test_a_database_url_with_a_wrong_parameter(
    settings: Settings, command: list[str], query: str, fragment: str
) -> None:
    """psycopg refuses them before it connects, with an error that is not an outage's: each
    command printed a traceback of over a hundred lines instead of this one."""
    env = outbox_env(settings, OUTBOX_DATABASE_URL=f"postgresql://app:s3cret@db/shop?{query}")
    result = run_outbox(None, *command, env=env)
    assert_one_line_error(result, "invalid database URL 'postgresql://app:***@db/shop?",
                          fragment)
    assert "s3cret" not in result.stderr


@pytest.mark.parametrize(
    ("args", "variables", "fragments"),
    [
        ([], {"OUTBOX_RECONCILE_THRESHOLDS": '{"lost_messages": 0}'},
         ["unknown finding lost_messages", "undelivered_after_sla"]),
        (["--threshold", "lost_messages=0"], {}, ["unknown finding lost_messages"]),
        ([], {"OUTBOX_RECONCILE_THRESHOLDS": '{"discarded": -1}'},
         ["threshold of discarded must be 0 or more"]),
        (["--output-dir", "/proc/outbox-reports"], {},
         ["cannot write the reconciliation's files under /proc/outbox-reports"]),
        (["--master", "nonsense://x"], {}, ["'nonsense://x' is not a Spark master", "local[*]"]),
        ([], {"OUTBOX_RECONCILE_SPARK_MASTER": "local[0]"},
         ["'local[0]' is not a Spark master"]),
    ],
    ids=["unknown-finding-env", "unknown-finding-option", "negative-threshold", "output-dir",
         "master-unknown", "master-no-threads"],
)
def test_a_reconciliation_misconfigured_says_so_before_spark_starts(
    settings: Settings, args: list[str], variables: dict[str, str], fragments: list[str]
) -> None:
    """Found before Spark's start (seconds, and lines of its own), not after the tables
    were read: one line, and nothing else."""
    result = run_outbox(None, "reconcile", *args, env=outbox_env(settings, **variables))
    assert_one_line_error(result, *fragments)


def test_a_spark_that_does_not_start_is_a_configuration_error_not_a_finding(
        settings: Settings, tmp_path: Path) -> None:
    """A master Spark accepts but cannot start under (YARN with no Hadoop configuration)
    gave a Python traceback and exit code 1, a run that found too much to a cron job. Spark's
    own lines come first; the command's last line says Spark did not start, and it exits 2."""
    env = {k: v for k, v in outbox_env(settings).items()
           if k not in ("HADOOP_CONF_DIR", "YARN_CONF_DIR")}
    result = run_outbox(None, "reconcile", "--master", "yarn", "--output-dir", str(tmp_path),
                        env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "outbox: error: Spark did not start with master 'yarn' (nothing was recorded; "
        "Spark's own lines above say why): [JAVA_GATEWAY_EXITED] Java gateway process exited "
        "before sending its port number.")


@pytest.mark.parametrize(("command", "table"), [
    (["status"], "pending"), (["discarded"], "pending"), (["resume", "--all"], "pending"),
    (["prune"], "pending"), (["prune"], "message")],
    ids=["status", "discarded", "resume", "prune-pending", "prune-message"])
def test_a_short_command_behind_a_table_lock_says_who_holds_it(
    settings: Settings, engine: Engine, command: list[str], table: str
) -> None:
    """An upgrade (or an operator's LOCK TABLE) holding the queue: a short command waits
    LOCK_WAIT_SECONDS at most, not for as long as the lock is held, and names the holder.
    `outbox prune` waited, silent, as long as ``message`` was locked, and behind a locked
    ``pending`` said `cannot use PostgreSQL at ...: canceling statement due to lock
    timeout`."""
    with engine.connect() as holder, holder.begin():
        holder.execute(text("SET LOCAL application_name = 'a long upgrade'"))
        holder.execute(text(f"LOCK TABLE {settings.schema_name}.{table} "
                            "IN ACCESS EXCLUSIVE MODE"))
        started = time.monotonic()
        result = run_outbox(settings, *command)
        waited = time.monotonic() - started
    assert_one_line_error(result, f"waited up to {LOCK_WAIT_SECONDS}s for a lock on schema "
                          f"{settings.schema_name}'s tables, held by pid",
                          "application 'a long upgrade'", "LOCK TABLE")
    assert waited < 60


@pytest.mark.parametrize("command", [["resume", "--all"], ["relay"], ["sweep"]])
def test_a_command_that_writes_to_a_read_only_database_says_so(
    settings: Settings, engine: Engine, command: list[str]
) -> None:
    """A role (or database) with default_transaction_read_only, as a DBA freezes writes: a
    command that writes gets one line, not a traceback. A relay ran for good, delivering
    nothing, and said once that it could not renew its leases."""
    login = f"frozen_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN SUPERUSER PASSWORD 'pw'"))
        conn.execute(text(f"ALTER ROLE {login} SET default_transaction_read_only = on"))
    try:
        url = settings.database_url.replace(
            f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
        result = run_outbox(None, *command, env=outbox_env(
            settings, OUTBOX_DATABASE_URL=url, OUTBOX_SQL_CHECKERS='{"g": "SELECT 1"}'))
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {login}"))
    assert_one_line_error(result, "refuses writes: it is read-only",
                          "target_session_attrs=read-write")


@pytest.mark.parametrize("command", [["relay"], ["sweep"], ["status"], ["resume", "1"],
                                     ["discarded"], ["prune"], ["db", "current"],
                                     ["db", "upgrade"]])
def test_a_database_that_never_answers_is_waited_for_once(settings: Settings,
                                                           command: list[str]) -> None:
    """Each connection waits OUTBOX_DATABASE_TCP_TIMEOUT, and a command tries one: the relay
    tried three (the CLI's pooler probe, the relay's own, then its work), the short commands
    two, and `db current` and `db upgrade` waited without the timeout (136 s)."""
    with mute_server() as (port, taken):
        env = outbox_env(settings, OUTBOX_DATABASE_URL=f"postgresql://app:pw@127.0.0.1:{port}/x",
                         OUTBOX_DATABASE_TCP_TIMEOUT="2", OUTBOX_SQL_CHECKERS='{"g": "SELECT 1"}')
        result = run_outbox(None, *command, env=env)
        assert_one_line_error(result, f"cannot use PostgreSQL at postgresql://app:***@127.0.0.1:"
                                      f"{port}/x", "timeout")
        assert len(taken) == 1


@pytest.mark.parametrize("command", ["relay", "sweep"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_daemon_starts_stops_it_at_once_with_a_line(
    settings: Settings, command: str, signum: signal.Signals
) -> None:
    """Here the database takes the connection and never answers (30 s): SIGTERM killed the
    starting daemon without a word (exit 143), SIGINT printed `Aborted!` (exit 1), or a
    traceback when it came during the imports."""
    with mute_server() as (port, taken):
        daemon = start_outbox(settings, command, OUTBOX_SQL_CHECKERS='{"g": "SELECT 1"}',
                              OUTBOX_DATABASE_URL=f"postgresql://app:pw@127.0.0.1:{port}/x")
        try:
            wait_until(lambda: len(taken) == 1, 30, "the daemon to connect")
            daemon.send_signal(signum)
            output, _ = daemon.communicate(timeout=10)
        finally:
            daemon.kill()
    name = "sweeper" if command == "sweep" else command
    assert (daemon.returncode, output.strip()) == (
        0, f"outbox: {name} stopped before it started ({signum.name})")


@pytest.mark.parametrize("command", ["relay", "sweep", "reconcile"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_daemon_is_still_imported_stops_it_at_once_with_a_line(
    settings: Settings, command: str, signum: signal.Signals
) -> None:
    """Signalled as it imports its command line (here once click is imported, before psycopg,
    SQLAlchemy and pydantic: the first half second of a daemon's life), the daemon had set no
    handler yet: SIGTERM killed it without a word (exit 143), SIGINT printed a traceback.
    Python's own import-time trace says when it got that far."""
    daemon = start_outbox(settings, command, OUTBOX_SQL_CHECKERS='{"g": "SELECT 1"}',
                          PYTHONPROFILEIMPORTTIME="1")
    try:
        wait_until(lambda: re.search(r"\|\s+click$", Path(daemon.log).read_text(), re.M)
                   is not None, 30, "the daemon to import click")
        daemon.send_signal(signum)
        output, _ = daemon.communicate(timeout=10)
    finally:
        daemon.kill()
    lines = [line for line in output.splitlines() if not line.startswith("import time:")]
    if command == "reconcile":  # a run that did not run: neither clean (0) nor findings (1)
        assert (daemon.returncode, lines) == (128 + signum, [
            f"outbox: reconciliation stopped before it started ({signum.name}): nothing was "
            "recorded"])
        return
    name = "sweeper" if command == "sweep" else command
    assert (daemon.returncode, lines) == (
        0, [f"outbox: {name} stopped before it started ({signum.name})"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_resume_all_stopped_by_a_signal_resumes_nothing_and_says_so(
    engine: Engine, settings: Settings, schema: str, signum: signal.Signals
) -> None:
    """SIGTERM killed `outbox resume --all` without a word (exit 143) while its statement
    waited for a row a relay held; Ctrl-C said 'Aborted!' and exit code 1, which resume
    means as 'some ids were not resumed'."""
    from sqlalchemy.orm import Session

    from outbox import Outbox

    with Session(engine) as session, session.begin():
        ids = [Outbox(settings=settings).publish(session, "t", {"n": n}) for n in range(3)]
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.pending SET status = 'PARKED'"))
    with engine.connect() as holder:
        holder.execute(text(f"SELECT 1 FROM {schema}.pending WHERE message_id = :id FOR UPDATE"),
                       {"id": ids[-1]})
        resuming = start_outbox(settings, "resume", "--all")
        wait_until(lambda: waits_for_a_row(engine, schema), 10, "resume to wait")
        resuming.send_signal(signum)
        output, _ = resuming.communicate(timeout=10)
    assert (resuming.returncode, output) == (128 + signum, (
        f"outbox: error: resume was stopped ({signum.name}): its transaction was rolled back, "
        "nothing was resumed\n"))
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.pending WHERE status = "
                                 "'PARKED'")).scalar_one() == 3
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.op_record WHERE action = "
                                 "'RESUMED'")).scalar_one() == 0


def waits_for_a_row(engine: Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :named"), {"named": f"%{schema}.pending%"}).scalar_one())
