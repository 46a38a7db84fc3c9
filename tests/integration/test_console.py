"""``outbox console`` over HTTP, run as a real process against the suite's services: its
numbers are the database's, payloads and keys render as text, and a resume happens only
with actions on, the right token, a form from its own page, under the console's role."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from pyspark.sql import SparkSession
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.console.overview import PREVIEW_BYTES, Deliveries
from outbox.dev import services as devservices
from outbox.settings import ConsoleSettings, Settings
from outbox.spark import reconcile as job
from outbox.spark.runs import RunOutcome
from tests.conftest import (
    assert_refused,
    count_status,
    drop_roles,
    publish_orders,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.integration import test_reconcile
from tests.integration.test_cli_errors import assert_one_line_error
from tests.processes import outbox_env, run_outbox, start_outbox
from tests.tcp_proxy import TcpProxy

#: The suite's one local SparkSession (test_reconcile.py's fixture).
spark = test_reconcile.spark
TOKEN = "correct horse battery staple"
SCRIPT = b"<script>alert('payload')</script>"
SCRIPT_KEY = "<script>alert('key')</script>"


@contextlib.contextmanager
def running_console(settings: Settings, *args: str, logs: list[str] | None = None,
                    stop: signal.Signals = signal.SIGTERM, **env: str) -> Iterator[str]:
    """``outbox console`` on a free loopback port until the block ends, then ``stop``;
    yields its URL (and appends what it printed to ``logs``)."""
    port = devservices.free_port()
    process = start_outbox(settings, "console", "--port", str(port), *args, **env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url) or process.poll() is not None, 30, "the console")
        assert process.poll() is None, process.communicate()[0]
        yield url
    finally:
        process.send_signal(stop)
        output, _ = process.communicate(timeout=30)
    if logs is not None:
        logs.append(output)
    assert process.returncode == 0, output
    assert f"serving the console on {url}" in output, "binds the loopback address by default"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).text == "ok"
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def with_actions(settings: Settings, logs: list[str] | None = None, **env: str
                 ) -> Iterator[str]:
    with running_console(settings, "--allow-actions", logs=logs, OUTBOX_CONSOLE_TOKEN=TOKEN,
                         **env) as url:
        yield url


@pytest.fixture
def parked(engine: Engine, settings: Settings, schema: str, topic: str) -> list[int]:
    """Two messages the broker really rejects (too large for a strict relay), PARKED; the
    first carries ``<script>`` in its payload and its key."""
    strict = settings.model_copy(update={"kafka_max_request_size": 20_000,
                                         "relay_max_attempts": 1})
    outbox = Outbox(settings=strict)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, SCRIPT + b"x" * 30_000, key=SCRIPT_KEY),
               outbox.publish(session, topic, b"y" * 30_000, key="plain")]
    with running_relay(strict):
        wait_until(lambda: count_status(engine, schema, "PARKED") == 2, 30, "parking")
    return ids


def form_of(client: httpx.Client, **fields: str | list[str]) -> dict[str, str | list[str]]:
    """The resume form as the console's page serves it (its CSRF field), with ``fields``."""
    page = client.get("/").text
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "the page offers the resume form"
    return {"csrf": match.group(1), "operator": "alice", "token": TOKEN, **fields}


def actions_of(engine: Engine, schema: str, message_id: int) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(text(
            f"SELECT action, actor FROM {schema}.op_record WHERE message_id = :id ORDER BY id"),
            {"id": message_id})]


def totals(page: str) -> dict[str, int]:
    return {state: int(n) for state, n in re.findall(r'id="total-(\w+)">(\d+)<', page)}


def test_the_page_shows_the_databases_backlog(
    engine: Engine, settings: Settings, schema: str, topic: str, parked: list[int]
) -> None:
    outbox = Outbox(settings=settings)
    with Session(engine) as session, session.begin():
        for n in range(3):
            outbox.publish(session, topic, {"n": n}, key="k")
        outbox.publish(session, topic, {"later": True}, deliver_after=timedelta(hours=1))
        outbox.prepare(session, topic, {"unsure": True})
    with engine.connect() as conn:
        states = dict(conn.execute(text(
            f"SELECT status, count(*) FROM {schema}.message_state GROUP BY status")).all())

    with running_console(settings) as url:
        page = httpx.get(url).text

    assert totals(page) == {"pending": 3, "unresolved": 1, "delayed": 1, "parked": 2,
                            "discarded": 0}
    assert states == {"PENDING": 4, "DELAYED": 1, "PARKED": 2}  # one PENDING is the UNKNOWN
    assert f'<tr data-topic="{topic}">' in page


def test_a_paused_relay_is_shown_with_how_long_and_why(
    engine: Engine, settings: Settings, schema: str
) -> None:
    """As its heartbeat says it (relay/leases.py); the reason, a broker's text, as text."""
    started = time.monotonic()
    with engine.begin() as conn:
        store.heartbeat(conn, schema, "relay-a", 10)
        store.heartbeat(conn, schema, "relay-b", 10,
                        paused=(42.0, "BrokerTrouble: <b>no brokers</b> available"))

    # alive: seen within the reader's lease, 3 s in these settings, which CI's start of the
    # console once outlasted (0 alive); and the pause shown grows while it starts
    with running_console(settings.model_copy(update={"relay_lease_seconds": 600})) as url:
        page = httpx.get(url).text
    waited = time.monotonic() - started

    rows = {worker: re.search(rf'<tr data-relay="{worker}">.*?</tr>', page, re.S)
            for worker in ("relay-a", "relay-b")}
    assert rows["relay-a"] is not None and rows["relay-b"] is not None, page
    assert "badge" not in rows["relay-a"].group(0)
    paused = rows["relay-b"].group(0)
    shown = re.search(r'<span class="badge bad">(\d+) s</span> BrokerTrouble: '
                      r"&lt;b&gt;no brokers&lt;/b&gt; available", paused)
    assert shown, paused
    assert 42 <= int(shown.group(1)) <= 42 + waited + 1, (shown.group(1), waited)


def test_payloads_and_keys_render_as_text(settings: Settings, parked: list[int]) -> None:
    with running_console(settings) as url:
        reply = httpx.get(url)

    assert "&lt;script&gt;alert(&#39;payload&#39;)&lt;/script&gt;" in reply.text
    assert "&lt;script&gt;alert(&#39;key&#39;)&lt;/script&gt;" in reply.text
    assert "<script>alert" not in reply.text
    assert "script-src 'nonce-" in reply.headers["content-security-policy"]
    shown = PREVIEW_BYTES - len(SCRIPT)
    assert "x" * shown in reply.text and "x" * (shown + 1) not in reply.text, "a capped preview"


def test_a_read_only_console_offers_no_action_and_refuses_one(
    engine: Engine, settings: Settings, schema: str, parked: list[int]
) -> None:
    logs: list[str] = []
    with running_console(settings, logs=logs, OUTBOX_CONSOLE_TOKEN=TOKEN) as url:
        page = httpx.get(url).text
        refused = httpx.post(f"{url}/resume", data={"one": str(parked[0]), "token": TOKEN,
                                                     "operator": "alice", "csrf": "x"},
                             cookies={"outbox_console_csrf": "x"})

    assert 'id="mode">read-only<' in page
    assert "<form class=\"resume\"" not in page and 'name="token"' not in page
    assert refused.status_code == 403 and "read-only" in refused.text
    assert count_status(engine, schema, "PARKED") == 2
    assert f"may delete the outbox's rows: run it as a member of {schema}_console" in logs[0]


def test_a_page_asked_for_under_another_name_is_refused(settings: Settings) -> None:
    """DNS rebinding: a site whose name resolves to 127.0.0.1 made the operator's browser
    ask the loopback console for its page (payload previews) under the site's own name, and
    read it. Only the names the console is reached by are answered."""
    with running_console(settings) as url:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(url, headers={"Host": f"rebind.attacker.example:{port}"}
                         ).status_code == 400
        assert httpx.get(url, headers={"Host": f"localhost:{port}"}).status_code == 200
        assert httpx.get(url).status_code == 200
    with running_console(settings, OUTBOX_CONSOLE_ALLOWED_HOSTS='["outbox.example.com"]'
                         ) as url:
        assert httpx.get(url, headers={"Host": "outbox.example.com"}).status_code == 200
        assert httpx.get(url).status_code == 400


@pytest.mark.parametrize("token", ["wrong", ""])
def test_a_wrong_or_missing_token_is_refused(
    engine: Engine, settings: Settings, schema: str, parked: list[int], token: str
) -> None:
    with with_actions(settings) as url, httpx.Client(base_url=url) as client:
        reply = client.post("/resume", data=form_of(client, one=str(parked[0]), token=token))

    assert reply.status_code == 403 and "wrong or missing token" in reply.text
    assert [action for action, _ in actions_of(engine, schema, parked[0])] == ["PARKED"]


def test_a_form_from_elsewhere_is_refused(
    engine: Engine, settings: Settings, schema: str, parked: list[int]
) -> None:
    with with_actions(settings) as url, httpx.Client(base_url=url) as client:
        form = form_of(client, one=str(parked[0]))
        forged = {**form, "csrf": "guessed"}
        no_cookie = httpx.post(f"{url}/resume", data=form)
        wrong_field = client.post("/resume", data=forged)
        other_site = client.post("/resume", data=form,
                                 headers={"origin": "https://evil.example"})
        as_get = client.get(f"/resume?one={parked[0]}&token={TOKEN}")

    for reply in (no_cookie, wrong_field, other_site):
        assert reply.status_code == 403 and "CSRF" in reply.text, reply.text
    assert as_get.status_code == 405
    assert count_status(engine, schema, "PARKED") == 2


def test_resume_a_selection_is_recorded_with_the_operators_name(
    engine: Engine, settings: Settings, schema: str, parked: list[int]
) -> None:
    with with_actions(settings) as url, httpx.Client(base_url=url) as client:
        reply = client.post("/resume", data=form_of(client, ids=[str(i) for i in parked]))

    assert reply.status_code == 200, reply.text
    for message_id in parked:
        assert f"message {message_id} (was PARKED)" in reply.text
        assert actions_of(engine, schema, message_id)[-1] == ("RESUMED", "console:alice")
    assert count_status(engine, schema, "PARKED") == 0


def test_a_resume_that_resumes_nothing_says_not_done(settings: Settings) -> None:
    """The page was headed "Resumed by console:alice" above "not resumed ...: 1"; `outbox
    resume 1` exits 1 for the same."""
    with with_actions(settings) as url, httpx.Client(base_url=url) as client:
        reply = client.post("/resume", data=form_of(client, ids=["999999"]))
        missing = [client.get(f"/runs/{run}/report")
                   for run in ["99999", "99999999999999999999", "-1", "x"]]
    assert reply.status_code == 409, reply.text
    assert "<h2>Not done</h2>" in reply.text and "Resumed by" not in reply.text
    assert "not resumed (unknown, or neither PARKED nor DISCARDED): 999999" in reply.text
    for answer in missing:  # a run id past bigint was a 500 (out of range in the database)
        assert answer.status_code == 404, answer.text[:300]
        assert "<title>report" in answer.text, answer.text[:300]


def test_a_database_that_stops_answering_is_said_on_the_page(settings: Settings) -> None:
    """With PostgreSQL away the console answered a bare "Internal Server Error" and logged
    three chained tracebacks a request; a topic filter holding NUL was a 500 too."""
    url = make_url(settings.database_url)
    proxy = TcpProxy(url.port or 5432)
    proxied = settings.model_copy(update={"database_url": url.set(
        host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)})
    logs: list[str] = []
    try:
        with running_console(proxied, logs=logs) as console:
            assert httpx.get(console, params={"topic": "a\x00b"}).status_code == 400
            proxy.cut()
            away = httpx.get(console, timeout=30)
            proxy.restore()
            back = httpx.get(console, timeout=30)
    finally:
        proxy.close()
    assert away.status_code == 503, away.text[:500]
    assert "PostgreSQL does not answer (OperationalError: " in away.text
    assert back.status_code == 200, back.text[:500]
    assert "Traceback" not in logs[0], logs[0]
    assert f"WARNING outbox.console: cannot read schema {settings.schema_name}: " \
           "OperationalError: " in logs[0]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT])
def test_the_console_stops_cleanly_on_sighup_and_ctrl_c_as_on_sigterm(
    settings: Settings, signum: signal.Signals
) -> None:
    """SIGHUP (a terminal or ssh session gone) killed the console without a word (exit 129):
    uvicorn handles only SIGINT and SIGTERM."""
    logs: list[str] = []
    with running_console(settings, logs=logs, stop=signum) as console:
        assert httpx.get(console).status_code == 200
    assert "Traceback" not in logs[0], logs[0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_console_stopped_while_it_waits_for_postgresql_at_start_exits_at_once(
    settings: Settings, signum: signal.Signals
) -> None:
    """The console set SIGTERM and Ctrl-C aside before its first connection: stopped while
    PostgreSQL did not answer, it went on waiting, and served once the database came back;
    SIGHUP killed it without a word."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts no connection, answers nothing
    waiting = settings.model_copy(update={"database_url": make_url(settings.database_url).set(
        host="127.0.0.1", port=silent.getsockname()[1]).render_as_string(hide_password=False)})
    try:
        process = start_outbox(waiting, "console", "--port", str(devservices.free_port()))
        time.sleep(2)  # its settings read, its first connection waits for an answer
        assert process.poll() is None, process.communicate()[0]
        process.send_signal(signum)
        output, _ = process.communicate(timeout=5)
    finally:
        silent.close()
    assert (process.returncode, output) == (
        0, f"outbox: console stopped before it served ({signum.name})\n")


def test_a_console_host_that_does_not_resolve_names_the_host(settings: Settings) -> None:
    """It said "Name or service not known; choose another --port"."""
    ran = run_outbox(settings, "console", "--host", "nosuch.invalid", "--port", "0")
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().endswith("; choose another --host"), ran.stderr


def test_actions_need_a_token_and_the_console_needs_its_extra(settings: Settings) -> None:
    no_token = run_outbox(settings, "console", "--allow-actions")
    blocked = "import sys; sys.modules['starlette'] = None; from outbox.cli import main; main()"
    without_extra = subprocess.run([sys.executable, "-c", blocked, "console"],
                                   capture_output=True, text=True, timeout=60)

    assert no_token.returncode == 2
    assert no_token.stderr.strip().splitlines() == [
        "outbox: error: --allow-actions needs a token: set OUTBOX_CONSOLE_TOKEN to a long "
        "random string (operators type it to resume messages)"]
    for weak, said in (("   ", "needs a token: set"),  # both were taken: a blank one,
                       ("hunter2", "needs a token of 16 characters or more")):  # a guessable
        short = run_outbox(None, "console", "--allow-actions",
                           env=outbox_env(settings, OUTBOX_CONSOLE_TOKEN=weak))
        assert short.returncode == 2, short.stderr
        assert said in short.stderr, short.stderr
    assert without_extra.returncode == 2
    (line,) = without_extra.stderr.strip().splitlines()
    assert line.startswith("outbox: error: console needs the console extra")
    assert line.endswith("pip install 'transactional-outbox[console]'")
    assert ConsoleSettings().console_host == "127.0.0.1"


def test_a_console_port_in_use_is_one_line_and_exit_2(settings: Settings) -> None:
    """uvicorn bound the port only once started: six lines, one an ERROR, and exit 3."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ran = run_outbox(settings, "console", "--port", str(port))
    assert_one_line_error(ran, f"outbox: error: cannot serve the console on 127.0.0.1:{port}: "
                          "Address already in use; choose another --port")


def test_the_console_role_reads_and_resumes_and_nothing_more(
    engine: Engine, settings: Settings, schema: str, parked: list[int]
) -> None:
    created = run_outbox(settings, "db", "upgrade", "--create-roles")
    assert created.returncode == 0, created.stderr
    login = f"{schema}_console_login"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' IN ROLE {schema}_console"))
    url = settings.database_url.replace(
        f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
    try:
        as_console = settings.model_copy(update={"database_url": url})
        logs: list[str] = []
        with with_actions(as_console, logs) as console, httpx.Client(base_url=console) as client:
            page = client.get("/").text
            reply = client.post("/resume", data=form_of(client, one=str(parked[0])))
        assert totals(page)["parked"] == 2
        assert "may delete" not in logs[0], "its own role is not warned about"
        assert reply.status_code == 200 and f"message {parked[0]} (was PARKED)" in reply.text
        assert_refused(url, [
            f"DELETE FROM {schema}.pending",
            f"DELETE FROM {schema}.message",
            f"UPDATE {schema}.message SET payload = 'forged'",
            f"UPDATE {schema}.pending SET resolution = 'COMMIT'",
            f"UPDATE {schema}.pending SET shard = 1",
            f"INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, "
            f"kafka_offset) VALUES ({parked[1]}, 'DELIVERED', 'x', 0, 0)",
            f"DELETE FROM {schema}.op_record",
            f"UPDATE {schema}.relay_lease SET owner = 'me'",
            f"INSERT INTO {schema}.relay_member (worker_id) VALUES ('me')",
            f"INSERT INTO {schema}.message (topic, payload, content_type, shard) "
            f"VALUES ('t', 'x', 'text/plain', 0)",
            f"DELETE FROM {schema}.reconcile_run",
        ])
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {login}"))
        drop_roles(engine, [f"{schema}_{kind}" for kind in (
            "app", "relay", "sweeper", "reconcile", "checker", "console")])


def test_reconciliation_runs_are_listed_with_their_report(
    spark: SparkSession, engine: Engine, settings: Settings, schema: str, topic: str,
    tmp_path: Path
) -> None:
    outbox = Outbox(settings=settings)
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, {"n": 1})
    run = job.run(spark, settings.model_copy(update={
        "reconcile_read_topics": False, "reconcile_output_dir": str(tmp_path)}))
    assert run.outcome is RunOutcome.CLEAN, run.summary
    (folder,) = tmp_path.iterdir()

    with running_console(settings) as url:
        page = httpx.get(url).text
        report = httpx.get(f"{url}/runs/1/report").text
        missing = httpx.get(f"{url}/runs/2/report")

    assert re.search(r'<tr data-run="1">.*?CLEAN', page, re.S)
    assert '<a href="/runs/1/report">' in page and str(folder) in page
    assert (folder / "report.txt").read_text().splitlines()[0] in report
    assert missing.status_code == 404


def test_the_compose_console_runs_read_only_as_its_login_role(
    engine: Engine, settings: Settings, schema: str
) -> None:
    """docker-compose.yml's console service: its command, its login role (made by
    deploy/postgres/console.sql, granted by the migrate service), its health check."""
    from tests.integration.test_compose import COMPOSE, ROOT, compose_env

    service = COMPOSE["services"]["console"]
    migrate = run_outbox(None, *COMPOSE["services"]["migrate"]["command"],
                         env=compose_env(settings))
    assert migrate.returncode == 0, migrate.stderr
    compose_url = make_url(service["environment"]["OUTBOX_DATABASE_URL"])
    login = f"{schema}_login"
    script = (ROOT / "deploy/postgres/console.sql").read_text()
    with engine.begin() as conn:
        conn.exec_driver_sql(script.replace("outbox_console", f"{schema}_console")
                             .replace(f"rolname = '{compose_url.username}'",
                                      f"rolname = '{login}'")
                             .replace(f"ROLE {compose_url.username} ", f"ROLE {login} "))
    url = settings.database_url.replace(
        f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:{compose_url.password}@")
    env = {**service["environment"], "OUTBOX_DATABASE_URL": url,
           "OUTBOX_SCHEMA": schema, "OUTBOX_CONSOLE_METRICS_URLS": "[]"}
    command = list(service["command"])
    port = devservices.free_port()
    command[command.index("--port") + 1] = str(port)
    known = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields} | {"OUTBOX_SCHEMA"}
    assert set(service["environment"]) <= known
    assert service["ports"] == ["127.0.0.1:8089:8089"], "published on the host's loopback"
    try:
        process = start_outbox(settings, *command, **env)
        try:
            wait_until(lambda: _healthy(f"http://127.0.0.1:{port}")
                       or process.poll() is not None, 30, "its health check")
            page = httpx.get(f"http://127.0.0.1:{port}/") if process.poll() is None else None
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {login}"))
        drop_roles(engine, [f"{schema}_{kind}" for kind in (
            "app", "relay", "sweeper", "reconcile", "checker", "console")])
    assert process.returncode == 0 and page is not None, output
    assert page.status_code == 200 and 'id="mode">read-only<' in page.text
    assert "127.0.0.1:8089/healthz" in service["healthcheck"]["test"][-1]


def test_a_refresh_reads_the_last_minutes_and_keeps_the_hours_totals(
    engine: Engine, settings: Settings, schema: str, topic: str
) -> None:
    """An open page re-reads only the last two minutes of deliveries; the hour's totals and
    percentiles come from the last whole read (here never due again)."""
    outbox = Outbox(settings=settings)
    kept = Deliveries(whole_every=3600)
    with running_relay(settings):
        publish_orders(engine, outbox, topic, [("a", 1), ("b", 2), ("c", 3)])
        wait_delivered(engine, schema, 3)
        with engine.connect() as conn:
            first, first_minutes = kept.read(conn, schema)
        publish_orders(engine, outbox, topic, [("a", 4), ("b", 5)])
        wait_delivered(engine, schema, 5)
    with engine.connect() as conn:
        again, minutes = kept.read(conn, schema)
        fresh, _ = Deliveries().read(conn, schema)

    assert first is not None and first["delivered"] == 3
    assert sum(row["delivered"] for row in first_minutes) == 3
    assert again is first, "the hour's totals are not read again before they are due"
    assert sum(row["delivered"] for row in minutes) == 5, "the last minutes are"
    assert fresh is not None and fresh["delivered"] == 5
    assert len(fresh["latency"]) == 3 and all(p > 0 for p in fresh["latency"])
