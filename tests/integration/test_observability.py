"""`outbox status` and the Prometheus metrics (retention: test_retention.py)."""

from __future__ import annotations

import json
import logging
import re
import signal
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest, start_http_server
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.dev import services as devservices
from outbox.settings import Settings
from tests.conftest import publish_orders, running_relay, wait_delivered, wait_until
from tests.processes import outbox_env, run_outbox, start_outbox


def test_status_reports_each_state_per_topic(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    publish_orders(engine, outbox, topic, [("a", 1), ("b", 2)])
    with running_relay(settings):
        wait_delivered(engine, schema, 2)
    publish_orders(engine, outbox, topic, [("c", 3)])  # pending: no relay runs now
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, "later", key="d", deliver_after=timedelta(hours=1))
        parked = outbox.publish(session, "other-topic", "x")
        discarded = outbox.prepare(session, "other-topic", "y")
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.pending SET status = 'PARKED' "
                          f"WHERE message_id = :id"), {"id": parked})
        conn.execute(text(f"UPDATE {schema}.pending SET status = 'DISCARDED' "
                          f"WHERE message_id = :id"), {"id": discarded})

    result = run_outbox(settings, "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_topic = {t["topic"]: t for t in report["topics"]}
    assert by_topic[topic]["pending"] == 1
    assert by_topic[topic]["delayed"] == 1
    assert by_topic[topic]["delivered_last_minute"] == 2
    assert by_topic[topic]["oldest_undelivered_seconds"] >= 0
    assert by_topic["other-topic"]["parked"] == 1
    assert by_topic["other-topic"]["discarded"] == 1
    assert by_topic["other-topic"]["unresolved"] == 0, "a discarded message is not unresolved"
    assert report["in_flight"] == 0 and report["relays"] == []

    text_report = run_outbox(settings, "status")
    assert text_report.returncode == 0, text_report.stderr
    assert topic in text_report.stdout and "delivered/min" in text_report.stdout
    assert settings.database_url.split("@")[0] not in text_report.stdout + text_report.stderr


def test_metrics_have_samples_before_anything_was_delivered(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    """A stall alert needs a series (at zero) to fire on, not HELP and TYPE lines alone:
    failure kinds exist from the start, a topic's series once the relay first fetches it."""
    from outbox.relay import metrics

    for kind in metrics.FAILURE_KINDS:
        assert re.search(rf'^outbox_delivery_failures_total{{kind="{kind}"}} \d',
                         generate_latest().decode(), re.MULTILINE)
    assert f'topic="{topic}"' not in generate_latest().decode()
    with running_relay(settings):
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1)
    body = generate_latest().decode()
    assert f'outbox_messages_parked_total{{topic="{topic}"}} 0.0' in body
    assert f'outbox_messages_delivered_total{{topic="{topic}"}} 1.0' in body


def test_relay_metrics_are_served_for_prometheus(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    port = devservices.free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1")
    try:
        with running_relay(settings):
            publish_orders(engine, outbox, topic, [(f"k{i}", i) for i in range(7)])
            wait_delivered(engine, schema, 7)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=5) as response:
                body = response.read().decode()
    finally:  # not left listening for the rest of the worker's session
        server.shutdown()
        server.server_close()
    assert f'outbox_messages_delivered_total{{topic="{topic}"}} 7.0' in body
    assert "outbox_delivery_latency_seconds_count" in body
    assert "outbox_relay_batch_size_bucket" in body
    assert "outbox_relay_owned_shards" in body
    assert 'outbox_messages{state="pending"}' in body


def test_a_sweeper_serves_its_own_metrics_and_not_the_relay_s(
    settings: Settings, roles: list[str]
) -> None:
    """`outbox sweep --metrics-port` served the relay's series too (owned shards 0, oldest
    pending 0: a sweeper is no relay), and logged its address as the relay. The schema has
    its roles: without the checker role a sweeper with SQL checkers stops at start, right
    after its server starts, and the read of its metrics raced its exit (CI on ebd9c3b)."""
    port = devservices.free_port()
    sweeper = start_outbox(settings, "sweep", "--metrics-port", str(port),
                           OUTBOX_SQL_CHECKERS='{"orders": "SELECT NULL"}')
    try:
        wait_until(lambda: "serving metrics" in Path(sweeper.log).read_text(), 60,
                   "the sweeper's metrics")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=5) as response:
                body = response.read().decode()
        except OSError as exc:  # a sweeper that ends takes its server along: its log says why
            pytest.fail(f"{exc!r}; the sweeper (exit code {sweeper.poll()}) printed:\n"
                        f"{Path(sweeper.log).read_text()}")
    finally:
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    assert "outbox_sweeper_paused 0.0" in body
    assert [line for line in body.splitlines() if line.startswith(
        ("outbox_relay_", "outbox_delivery_", "outbox_oldest_pending"))] == []
    assert f"INFO outbox.sweeper: serving metrics on http://0.0.0.0:{port}/metrics" in output


def test_backlog_gauges_count_pending_rows_and_the_oldest_ones_wait(
    engine: Engine, outbox: Outbox, schema: str, topic: str
) -> None:
    from prometheus_client import REGISTRY

    from outbox.relay import metrics

    publish_orders(engine, outbox, topic, [("a", 1), ("b", 2)])  # no relay runs
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.pending SET created_at = now() - interval '90 s'"))
    with engine.connect() as conn:
        metrics.observe_backlog(conn, schema)
    assert REGISTRY.get_sample_value("outbox_messages", {"state": "pending"}) == 2
    oldest = REGISTRY.get_sample_value("outbox_oldest_pending_seconds")
    assert oldest is not None and 90 <= oldest < 120


def test_a_slow_backlog_count_is_cut_off_and_the_next_waits_twenty_times_as_long(
    engine: Engine, outbox: Outbox, schema: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease keeper counts the backlog between renewals, and the count reads every
    pending row: with millions queued (a catch-up) it could hold a renewal past the lease.
    A count that takes too long is cut off, and the next waits 20 times as long."""
    from prometheus_client import REGISTRY

    from outbox.relay import metrics

    def pending() -> float | None:
        return REGISTRY.get_sample_value("outbox_messages", {"state": "pending"})

    skipped = [0.0]  # seconds the gauges' clock is ahead of the real one

    def clock() -> float:
        return time.monotonic() + skipped[0]

    def skip_to_due() -> None:
        skipped[0] += max(0.0, gauges.due - clock())

    gauges = metrics.BacklogGauges(schema, 0.3, clock=clock)
    publish_orders(engine, outbox, topic, [("a", 1), ("b", 2)])
    with engine.connect() as conn, engine.connect() as locker:
        gauges.observe(conn)
        assert pending() == 2
        publish_orders(engine, outbox, topic, [("c", 3)])
        for _ in range(2):  # the count waits for this lock past its 0.3 s, twice
            skip_to_due()
            with locker.begin():
                locker.execute(text(f"LOCK TABLE {schema}.pending IN ACCESS EXCLUSIVE MODE"))
                started = clock()
                with caplog.at_level(logging.WARNING, logger="outbox.relay"):
                    gauges.observe(conn)
                took = clock() - started
            assert 0.3 <= took < 3
            assert pending() == 2, "the gauges keep their last count"
            assert gauges.due >= started + 20 * 0.3, "the next count waits 20 times as long"
            gauges.observe(conn)  # nothing holds it up now, but it is not due
            assert pending() == 2
        warned = [r for r in caplog.records if "counting the backlog took over 0.3s" in r.message]
        assert len(warned) == 1, "said once, not at every try"
        skip_to_due()
        with caplog.at_level(logging.INFO, logger="outbox.relay"):
            gauges.observe(conn)
        assert pending() == 3
        assert "the backlog is counted again" in caplog.text
        assert conn.execute(text("SHOW statement_timeout")).scalar_one() == "0", \
            "the cut-off is the count's transaction's alone"


def test_a_relay_with_a_longer_lease_than_the_reader_s_is_alive_between_its_beats(
    engine: Engine, schema: str
) -> None:
    """`outbox status` judged relays by its own ``relay_lease_seconds``: a relay started with
    ``--lease-seconds 60`` beats every 20 s and was counted alive and dead in turn. A relay
    holding a lease not expired is alive, whenever it last beat."""
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {schema}.relay_member (worker_id, seen_at, in_flight) "
            f"VALUES ('patient', now() - interval '15 seconds', 0), "
            f"('gone', now() - interval '15 seconds', 0)"))
        conn.execute(text(
            f"INSERT INTO {schema}.relay_lease (shard, owner, expires_at) "
            f"SELECT shard, 'patient', now() + interval '45 seconds' FROM generate_series(0, 2) "
            f"AS shard ON CONFLICT (shard) DO UPDATE SET owner = EXCLUDED.owner, "
            f"expires_at = EXCLUDED.expires_at"))
        assert [(r["worker_id"], r["shards"]) for r in store.relays(conn, schema, 10)] == [
            ("patient", 3)]


def test_status_reads_only_the_settings_it_uses(settings: Settings) -> None:
    """A reconciliation's, the sweeper's checkers' or the relay's Kafka setting that was bad
    stopped `outbox status` (with pydantic's wording), in the shell where an operator looks
    at what is wrong; one it uses is still refused."""
    unrelated = outbox_env(settings, OUTBOX_RECONCILE_THRESHOLDS="{not json",
                           OUTBOX_SQL_CHECKERS='{"g": ""}', OUTBOX_KAFKA_BOOTSTRAP="a b:9092",
                           OUTBOX_RELAY_BATCH_SIZE="0", OUTBOX_CONSOLE_PORT="-1")
    result = run_outbox(None, "status", env=unrelated)
    assert result.returncode == 0, result.stderr
    assert f"schema {settings.schema_name}: 0 relays alive" in result.stdout
    used = run_outbox(None, "status", env={**unrelated, "OUTBOX_RELAY_LEASE_SECONDS": "0"})
    assert used.returncode == 2 and "OUTBOX_RELAY_LEASE_SECONDS: " in used.stderr, used.stderr
