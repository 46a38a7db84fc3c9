"""Misconfiguration an operator can make gets one line and exit code 2, never a traceback,
and never a retry loop that cannot succeed (issue: production hazards §4)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text

from outbox import Outbox
from outbox.settings import RESERVED_WORDS, Settings
from tests.conftest import count_status, drop_schema, publish_orders, wait_until
from tests.integration.test_cli_errors import assert_one_line_error
from tests.processes import outbox_env, run_outbox, start_outbox


@pytest.fixture
def login_url(engine: Engine, settings: Settings) -> Iterator[str]:
    """A login role that was granted nothing."""
    role = f"nogrant_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
    url = make_url(settings.database_url).set(username=role, password="pw")
    yield url.render_as_string(hide_password=False)
    with engine.begin() as conn:
        conn.execute(text(f"DROP OWNED BY {role}"))
        conn.execute(text(f"DROP ROLE {role}"))


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("db", "upgrade", "--revision", "nosuchrev"), "nosuchrev"),
        (("db", "downgrade", "nosuchrev"), "nosuchrev"),
        (("db", "upgrade", "--revision", "0001"), "an upgrade does not go back; `outbox "),
        (("relay",), "OUTBOX_RELAY_LEASE_SECONDS: "),
        (("sweep",), "OUTBOX_CHECKER_TIMEOUT: "),
        (("sweep", "--metrics-port", "99999"), "sweep_metrics_port"),
    ],
    ids=["upgrade-unknown-revision", "downgrade-unknown-revision", "upgrade-to-an-older-one",
         "lease-inf", "timeout-inf",
         "port-beyond-65535"],
)
def test_bad_values_get_one_line(settings: Settings, args: tuple[str, ...], fragment: str
                                 ) -> None:
    env = outbox_env(settings, OUTBOX_SQL_CHECKERS='{"g": "SELECT 1"}')
    if "relay" in args:
        env["OUTBOX_RELAY_LEASE_SECONDS"] = "inf"
    if args == ("sweep",):
        env["OUTBOX_CHECKER_TIMEOUT"] = "inf"
    assert_one_line_error(run_outbox(None, *args, env=env), fragment)


@pytest.mark.parametrize("lease", ["0.001", "nan", "-1"])
def test_a_lease_too_short_to_renew_is_refused(settings: Settings, lease: str) -> None:
    result = run_outbox(None, "relay", env=outbox_env(settings,
                                                       OUTBOX_RELAY_LEASE_SECONDS=lease))
    assert_one_line_error(result, "OUTBOX_RELAY_LEASE_SECONDS: ")


@pytest.mark.parametrize(
    "args",
    [("discarded", "--limit", "-1"), ("resume", "99999999999999999999")],
    ids=["negative-limit", "id-beyond-bigint"],
)
def test_out_of_range_arguments_are_usage_errors(settings: Settings, args: tuple[str, ...]
                                                 ) -> None:
    result = run_outbox(settings, *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Error: Invalid value" in result.stderr


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text("relay_batch_size = = 5\n")
    result = run_outbox(None, "--config", str(config), "config")
    assert_one_line_error(result, str(config), "not valid TOML")


def test_a_metrics_port_in_use_gets_one_line(settings: Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_outbox(settings, "relay", "--metrics-port", str(port))
    assert_one_line_error(result, f"cannot serve metrics on 0.0.0.0:{port}")


@pytest.mark.parametrize("args", [("status",), ("resume", "1"), ("prune",), ("discarded",),
                                  ("db", "upgrade"), ("db", "downgrade", "base")])
def test_a_role_without_grants_gets_one_line(settings: Settings, login_url: str,
                                             args: tuple[str, ...]) -> None:
    result = run_outbox(None, *args, env=outbox_env(settings, OUTBOX_DATABASE_URL=login_url))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert ("lacks a privilege" in result.stderr or "is not migrated" in result.stderr
            or "permission denied" in result.stderr), result.stderr
    if args[0] == "db":  # it said to run `outbox db upgrade`: the command that just failed
        assert "may not migrate schema" in result.stderr and "run `outbox db upgrade`" \
            not in result.stderr, result.stderr


def test_a_relay_under_the_application_role_stops_instead_of_retrying(
    engine: Engine, settings: Settings, schema: str
) -> None:
    assert run_outbox(settings, "db", "upgrade", "--create-roles").returncode == 0
    login = f"{schema}_applogin"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' IN ROLE {schema}_app"))
    url = make_url(settings.database_url).set(username=login, password="pw")
    try:
        result = run_outbox(None, "relay", env=outbox_env(
            settings, OUTBOX_DATABASE_URL=url.render_as_string(hide_password=False)))
        assert result.returncode == 2, result.stderr
        assert "lacks a privilege" in result.stderr.splitlines()[-1], result.stderr
        assert "Traceback" not in result.stderr
        # it never held a shard: "could not hand back its shards ...; they expire in 3s"
        assert "shards" not in result.stderr, result.stderr
    finally:
        with engine.begin() as conn:
            for role in (login, f"{schema}_app", f"{schema}_relay", f"{schema}_sweeper"):
                conn.execute(text(f"DROP OWNED BY {role}"))
                conn.execute(text(f"DROP ROLE {role}"))


def test_two_upgrades_at_once_on_a_new_schema_both_succeed(settings: Settings) -> None:
    for _ in range(3):
        env = outbox_env(settings, OUTBOX_SCHEMA=f"race_{uuid.uuid4().hex[:8]}")
        runs = [subprocess.Popen([sys.executable, "-m", "outbox", "db", "upgrade"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
        outcomes = [(run.wait(120), run.stderr.read() if run.stderr else "") for run in runs]
        assert [code for code, _ in outcomes] == [0, 0], outcomes


def test_migrating_and_pruning_are_not_stopped_by_the_relay_s_own_settings(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """`outbox db upgrade` and `outbox prune` read every relay setting: a migration job or a
    cron prune sharing the relay's variables, without its TLS files mounted (or with a
    batch size being changed for the relay), was refused over a setting it never uses."""
    schema = f"shared_{uuid.uuid4().hex[:8]}"
    env = outbox_env(settings, OUTBOX_SCHEMA=schema, OUTBOX_KAFKA_SECURITY_PROTOCOL="SSL",
                     OUTBOX_KAFKA_SSL_CAFILE=str(tmp_path / "not-mounted.pem"),
                     OUTBOX_RELAY_BATCH_SIZE="0")
    try:
        upgraded = run_outbox(None, "db", "upgrade", env=env)
        assert upgraded.returncode == 0, upgraded.stderr
        pruned = run_outbox(None, "prune", env=env)
        assert pruned.returncode == 0, pruned.stderr
        assert pruned.stdout.startswith("dropped 0 partitions older than 72 h")
        assert_one_line_error(run_outbox(None, "relay", env=env), "OUTBOX_RELAY_BATCH_SIZE: ")
    finally:
        drop_schema(engine, schema)


def test_an_unknown_outbox_variable_is_reported(settings: Settings) -> None:
    result = run_outbox(None, "config", env=outbox_env(settings, OUTBOX_RELAY_BACH_SIZE="5"))
    assert result.returncode == 0
    assert ("unknown setting OUTBOX_RELAY_BACH_SIZE is ignored (did you mean "
            "OUTBOX_RELAY_BATCH_SIZE?)") in result.stderr


def test_the_reserved_words_refused_as_schema_names_are_the_servers(engine: Engine) -> None:
    """A schema named ``user`` passed the name check, then `outbox db upgrade` failed with
    a syntax error and a traceback: PostgreSQL's reserved words cannot be written unquoted.
    The list the settings refuse is the server's own."""
    with engine.connect() as conn:
        server = set(conn.execute(text(
            "SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')")).scalars())
    assert server == RESERVED_WORDS


def test_a_reserved_word_as_schema_gets_one_line(settings: Settings) -> None:
    env = outbox_env(settings, OUTBOX_SCHEMA="user")
    assert_one_line_error(run_outbox(None, "db", "upgrade", env=env), "schema name 'user'")


def test_a_one_millisecond_statement_timeout_in_the_url_stops_no_relay_or_command(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    """``?options=-c statement_timeout=1`` (1 ms, meant as a second) cancelled SQLAlchemy's
    first look at the server's types, made before the outbox set its sessions' timeouts
    aside, and about one time in ten the statement that sets them aside: the relay exited 2
    ("cannot use PostgreSQL at ...: canceling statement due to statement timeout"), and so
    did `outbox status`. The outbox's sessions now lift it first, alone."""
    url = make_url(settings.database_url).update_query_dict(
        {"options": "-c statement_timeout=1"}).render_as_string(hide_password=False)
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(30)])
    relay = start_outbox(settings, "relay", OUTBOX_DATABASE_URL=url)
    try:
        wait_until(lambda: relay.poll() is not None
                   or count_status(engine, schema, "DELIVERED") == len(ids), 60,
                   "the messages to be delivered")
        assert relay.poll() is None, relay.communicate()[0]
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    finally:
        relay.kill()
    assert relay.returncode == 0, output
    assert "paused" not in output and "failed" not in output, output
    for command in (["status"], ["db", "upgrade"]):
        result = run_outbox(None, *command, env=outbox_env(settings, OUTBOX_DATABASE_URL=url))
        assert result.returncode == 0, (command, result.stderr)
