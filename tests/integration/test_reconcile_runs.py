"""Reconciliation runs take turns per schema, and run under the least-privilege reconcile
role: read-only on the outbox tables, writing only reconcile_run, still holding the window
end back for other roles' open transactions (issue 15, "no blind spots")."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from outbox import ConfigurationError, Outbox, migrate
from outbox.cli import main
from outbox.dev import services as devservices
from outbox.settings import Settings, sqlalchemy_url
from outbox.spark import reconcile as job
from outbox.spark.runs import RUN_LOCK_CLASS, RunOutcome
from tests.conftest import assert_refused, publish_orders, running_relay, wait_delivered, wait_until
from tests.integration import test_reconcile
from tests.processes import alive, children, outbox_env, start_outbox

#: The suite's one local SparkSession (test_reconcile.py's fixture).
spark = test_reconcile.spark


def tables_only(services: devservices.Services, schema: str, output: Path,
                database_url: str | None = None) -> Settings:
    return test_reconcile.reconcile_settings(services, schema, output).model_copy(update={
        "reconcile_read_topics": False, "database_url": database_url or services.database_url})


def holds_run_lock(engine: Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = :lock_class AND objid::bigint = hashtext(:schema)::bigint & 4294967295"
        ), {"lock_class": RUN_LOCK_CLASS, "schema": schema}).scalar_one())


@pytest.mark.slow
def test_a_second_run_of_the_schema_exits_while_the_first_runs_then_follows_it(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    tmp_path: Path
) -> None:
    settings = tables_only(services, schema, tmp_path)
    publish_orders(engine, Outbox(settings=settings), "orders", [("k", 1), ("k", 2)])
    env = {"OUTBOX_DATABASE_URL": services.database_url, "OUTBOX_SCHEMA": schema,
           "OUTBOX_RECONCILE_OUTPUT_DIR": str(tmp_path)}
    with engine.connect() as blocker:
        # The first run takes the run lock, then waits here, reading the last run's end.
        blocker.execute(text(f"LOCK TABLE {schema}.reconcile_run IN ACCESS EXCLUSIVE MODE"))
        first = subprocess.Popen(
            [sys.executable, "-m", "outbox", "reconcile", "--tables-only", "--master", "local[1]"],
            env=outbox_env(settings, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            wait_until(lambda: holds_run_lock(engine, schema), 120, "the first run's lock")
            second = CliRunner().invoke(main, ["reconcile", "--tables-only"], env=env)
        finally:
            blocker.rollback()
            output, errors = first.communicate(timeout=180)

    assert second.exit_code == 3, second.output
    assert second.stderr.strip().splitlines() == [
        f"outbox: another reconciliation run of schema {schema!r} is in progress; this one did "
        "nothing (runs of a schema take turns: start the next when it ends)"]
    assert first.returncode == 0, errors[-3000:]
    assert "reconciliation run 1: CLEAN" in output
    assert "still running" not in errors, "a progress line before reconcile_progress_seconds"
    assert "py4j" not in errors, "Spark's bridge logged its close at exit, after the report"
    after = job.run(spark, settings, until=datetime.now(UTC))
    with engine.connect() as conn:
        windows = conn.execute(text(
            f"SELECT window_since, window_until FROM {schema}.reconcile_run ORDER BY id")).all()
    assert len(windows) == 2 and windows[1].window_since == windows[0].window_until
    assert after.summary["counts"]["messages"] == 2


@pytest.fixture
def reconcile_login(engine: Engine, services: devservices.Services, schema: str
                    ) -> Iterator[str]:
    """The URL of a login role that is a member of ``<schema>_reconcile``, made by
    ``create_roles`` (what ``outbox db upgrade --create-roles`` runs)."""
    roles = migrate.create_roles(services.database_url, schema)
    assert f"{schema}_reconcile" in roles
    login = f"{schema}_reconcile_login"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' IN ROLE {schema}_reconcile"))
    yield services.database_url.replace(
        f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
    with engine.begin() as conn:
        for role in [login, *roles]:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


def test_reconciliation_under_the_reconcile_role_holds_back_for_other_roles_transactions(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    reconcile_login: str, tmp_path: Path
) -> None:
    settings = tables_only(services, schema, tmp_path, reconcile_login)
    publish_orders(engine, Outbox(settings=settings), "orders", [("k", 1), ("k", 2), ("j", 3)])
    with engine.connect() as other_role:
        opened = other_role.execute(text(
            "SELECT xact_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")).scalar_one()
        try:
            result = job.run(spark, settings, until=datetime.now(UTC))
        finally:
            other_role.rollback()

    assert result.window.until == opened
    assert result.outcome is RunOutcome.CLEAN
    assert result.summary["counts"]["messages"] == 3


def test_the_reconcile_role_reads_but_changes_nothing_except_its_runs(
    schema: str, reconcile_login: str
) -> None:
    as_reconcile = create_engine(sqlalchemy_url(reconcile_login))
    try:
        with as_reconcile.connect() as conn:
            assert conn.execute(text(f"SELECT count(payload) FROM {schema}.message")).scalar() == 0
    finally:
        as_reconcile.dispose()
    assert_refused(reconcile_login, [
        f"UPDATE {schema}.message SET topic = topic",
        f"UPDATE {schema}.pending SET status = status",
        f"DELETE FROM {schema}.op_record",
        f"DELETE FROM {schema}.reconcile_run",
        f"INSERT INTO {schema}.message (topic) VALUES ('forged')",
    ])


@pytest.mark.parametrize(("revoke", "said"), [
    ("REVOKE pg_read_all_stats FROM {schema}_reconcile",
     "cannot see other sessions' transactions"),
    # found only at the end, after the whole job, with the report unprinted
    ("REVOKE INSERT ON {schema}.reconcile_run FROM {schema}_reconcile",
     r"may not record a run in .*\(INSERT\)"),
])
def test_a_role_that_cannot_hold_back_or_record_the_run_is_refused_before_it_reads(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    reconcile_login: str, tmp_path: Path, revoke: str, said: str
) -> None:
    with engine.begin() as conn:
        conn.execute(text(revoke.format(schema=schema)))
    settings = tables_only(services, schema, tmp_path, reconcile_login)

    with pytest.raises(ConfigurationError, match=said):
        job.preflight(settings)
    with pytest.raises(ConfigurationError, match=said):
        job.run(spark, settings, until=datetime.now(UTC))
    assert not any(tmp_path.iterdir())


def test_a_run_that_fails_before_it_is_recorded_leaves_no_run_folder(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    tmp_path: Path
) -> None:
    """A run that lost PostgreSQL as it recorded itself (here a trigger refuses the row)
    left its findings and carry in a run folder without a report, which no run reads and
    an operator may take for a run's."""
    settings = tables_only(services, schema, tmp_path)
    publish_orders(engine, Outbox(settings=settings), "orders", [("k", 1)])
    with engine.begin() as conn:
        conn.execute(text(f"CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql "
                          f"AS $$ BEGIN RAISE EXCEPTION 'the disk is full'; END $$"))
        conn.execute(text(f"CREATE TRIGGER refuse BEFORE INSERT ON {schema}.reconcile_run "
                          f"FOR EACH ROW EXECUTE FUNCTION {schema}.refuse()"))

    with pytest.raises(DBAPIError, match="the disk is full"):
        job.run(spark, settings, until=datetime.now(UTC))

    assert not list(tmp_path.glob("run-*"))


def test_a_run_names_its_phase_and_tasks_while_its_spark_jobs_work(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run said nothing while a Spark job worked: for 120 s while a dead broker stalled
    its read of the topics (then it exited 4), for minutes on a healthy large window. Every
    ``reconcile_progress_seconds`` (here 0.2) that a job works, it says where the run is."""
    settings = test_reconcile.reconcile_settings(services, schema, tmp_path).model_copy(
        update={"reconcile_progress_seconds": 0.2})
    with running_relay(settings):
        publish_orders(engine, Outbox(settings=settings), topic,
                       [(f"k{i % 3}", i) for i in range(20)])
        wait_delivered(engine, schema, 20)

    with caplog.at_level("INFO", logger="outbox.reconcile"):
        result = job.run(spark, settings, until=datetime.now(UTC))

    phases = "|".join(map(re.escape, result.summary["seconds_by_phase"]))
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert said, "no progress line"
    for line in said:
        assert re.fullmatch(rf"still running after \d+s \(({phases})\): (\d+ of \d+ tasks "
                            r"done, \d+ running|the driver's own work, no Spark job)", line), line
    assert any("tasks done" in line for line in said), said
    assert "reconcile-progress" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("free_kib", [4, 36, 44, 48],
                         ids=["findings", "carry", "summary", "report"])
def test_a_run_whose_disk_fills_up_records_nothing_and_exits_4(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    small_disk: Path, free_kib: int
) -> None:
    """A disk that filled up as Spark wrote the findings exited 4, nothing recorded. As the
    run wrote its carry-over or its report, the same disk gave a traceback and exit code 1,
    a run that found too much to a cron job; at the summary or the report, the run had been
    recorded with a folder that held neither. With the room left here each of those files is
    the one that does not fit (what one run of an empty window writes: it needs about 50 KiB
    in all); the next run, with room, covers the same window."""
    (small_disk / "filler").write_bytes(bytes((64 - free_kib) * 1024))
    env = {"OUTBOX_DATABASE_URL": services.database_url, "OUTBOX_SCHEMA": schema,
           "OUTBOX_RECONCILE_OUTPUT_DIR": str(small_disk / "out")}

    full = CliRunner().invoke(main, ["reconcile", "--tables-only"], env=env)

    assert full.exit_code == 4, full.output
    assert full.stderr.strip().splitlines()[-1].startswith(
        "outbox: error: the reconciliation job failed as it ran (nothing was recorded; the "
        "next run reads the same window): "), full.stderr[-2000:]
    assert "No space left on device" in full.stderr.strip().splitlines()[-1]
    assert list((small_disk / "out").glob("run-*")) == [], "an unrecorded run's folder"
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.reconcile_run")).scalar() == 0

    (small_disk / "filler").unlink()
    room = CliRunner().invoke(main, ["reconcile", "--tables-only"], env=env)
    assert room.exit_code == 0, room.output
    assert re.search(r"reconciliation run \d+: CLEAN\nwindow    beginning \.\. .* \(first run\)",
                     room.stdout), room.stdout  # its id may be the next: sequences do not roll back


@pytest.mark.parametrize(("moment", "line", "signum"), [
    ("as Spark starts", "Using incubator modules", signal.SIGTERM),
    ("as it reads the tables", "outbox.reconcile: window ", signal.SIGINT),
    ("as it reads the tables", "outbox.reconcile: window ", signal.SIGTERM),
], ids=["SIGTERM-as-spark-starts", "SIGINT-as-it-reads", "SIGTERM-as-it-reads"])
def test_a_run_stopped_by_a_signal_says_so_records_nothing_and_leaves_no_spark_behind(
    services: devservices.Services, engine: Engine, schema: str, tmp_path: Path,
    moment: str, line: str, signum: signal.Signals
) -> None:
    """SIGTERM killed a run without a word (exit 143); as Spark started, it left Spark's JVM
    running with no parent. Ctrl-C (PySpark's own handler) gave a traceback and exit code 1,
    a run that found too much. Now the run is undone on the path of a failed one, the
    command says it was stopped, and exits as a shell says a signal ended it."""
    settings = tables_only(services, schema, tmp_path)
    publish_orders(engine, Outbox(settings=settings), "orders", [("k", 1), ("k", 2)])
    run = start_outbox(settings, "reconcile", "--tables-only", "--master", "local[1]",
                       OUTBOX_RECONCILE_OUTPUT_DIR=str(tmp_path), OUTBOX_LOG_LEVEL="INFO")
    try:
        wait_until(lambda: line in Path(run.log).read_text(), 120, f"the run {moment}")
        spark = children(run.pid)
        run.send_signal(signum)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()

    assert run.returncode == 128 + signum, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        f"outbox: error: the reconciliation was stopped ({signum.name}): nothing was recorded; "
        "the next run reads the same window"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert list(tmp_path.glob("run-*")) == []
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.reconcile_run")).scalar() == 0
    assert not holds_run_lock(engine, schema)
    assert spark, "Spark's JVM, started by the run"
    wait_until(lambda: not any(alive(pid) for pid in spark), 30, "Spark's JVM to exit")
