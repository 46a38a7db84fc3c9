"""Faults injected for real: the broker's connections cut, PostgreSQL restarted, records the
broker refuses, a session idle in transaction (docs/guarantees.md)."""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, create_engine, make_url, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.dev import services as devservices
from outbox.dev.topics import Record, read_topic
from outbox.encoding import SHARDS
from outbox.relay.sweeper import Sweeper
from outbox.relay.wakeup import Wakeup
from outbox.settings import Settings
from tests.blackhole import cut_off, silenced, unanswered_connects
from tests.conftest import (
    both_transports,
    count_status,
    ids_with_status,
    publish_orders,
    running,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.isolated import Isolated, isolated_services
from tests.processes import OutboxProcess, outbox_env, run_outbox, start_outbox
from tests.tcp_proxy import TcpProxy


@pytest.fixture
def isolated(kafka_client: str) -> Iterator[Isolated]:
    with isolated_services(kafka_client=kafka_client) as iso:
        yield iso


def first_occurrences_in_order(records: list[Record]) -> bool:
    seen: set[int] = set()
    last: dict[bytes | None, int] = {}
    for record in records:
        mid = record.message_id
        assert mid is not None
        if mid in seen:
            continue
        seen.add(mid)
        if record.key in last and last[record.key] > mid:
            return False
        last[record.key] = mid
    return True


@both_transports
def test_broker_cut_delays_delivery_then_it_resumes_with_nothing_lost(
    isolated: Isolated, caplog: pytest.LogCaptureFixture, kafka_client: str
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    iso = isolated
    with running_relay(iso.settings):
        first = publish_orders(iso.engine, iso.outbox, iso.topic,
                               [(f"k{i % 10}", i) for i in range(100)])
        wait_delivered(iso.engine, "outbox", 100)
        iso.proxy.cut()
        during = []
        for start in range(0, 250, 50):
            orders = [(f"k{i % 10}", i) for i in range(start, start + 50)]
            during += publish_orders(iso.engine, iso.outbox, iso.topic, orders)
        wait_until(lambda: "has not acknowledged" in caplog.text, 20, "the outage to be logged")
        assert count_status(iso.engine, "outbox", "DELIVERED") == 100
        iso.proxy.restore()
        wait_delivered(iso.engine, "outbox", 350, timeout=90)
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} == set(first + during)
    assert first_occurrences_in_order(records)
    outage_lines = [r for r in caplog.records if "has not acknowledged" in r.getMessage()]
    assert len(outage_lines) == 1, "the outage is reported once, not per message"
    assert "delivering again after" in caplog.text
    if kafka_client == "confluent":  # kafka-python's own lines are silenced by the CLI
        lines = Counter(re.sub(r"\d+", "N", r.getMessage()) for r in caplog.records
                        if r.name == "outbox.relay.librdkafka")
        assert lines, "librdkafka said nothing of the outage"
        assert max(lines.values()) == 1, f"librdkafka repeats itself: {lines.most_common(3)}"


def over_a_cut(iso: Isolated, caplog: pytest.LogCaptureFixture, delivered: int,
               sent_into_it: int, then: float = 0) -> tuple[list[int], list[int]]:
    """A relay whose producer gives up after 2 s delivers ``delivered`` messages; the
    broker is cut off, ``sent_into_it`` more are published, a pass fails, and ``then``
    seconds later the broker is back. Returns the ids published before and during the cut,
    once all are delivered."""
    impatient = iso.settings.model_copy(update={
        "kafka_delivery_timeout_ms": 2_000, "kafka_connect_timeout_ms": 1_000})
    with running_relay(impatient):
        first = publish_orders(iso.engine, iso.outbox, iso.topic,
                               [(f"k{i % 10}", i) for i in range(delivered)])
        wait_delivered(iso.engine, "outbox", delivered)
        iso.proxy.cut()
        during = publish_orders(iso.engine, iso.outbox, iso.topic,
                                [(f"k{i % 10}", i)
                                 for i in range(delivered, delivered + sent_into_it)])
        wait_until(lambda: "paused" in caplog.text, 30, "a pass to fail")
        time.sleep(then)
        iso.proxy.restore()
        wait_delivered(iso.engine, "outbox", delivered + sent_into_it, timeout=90)
    return first, during


@both_transports
def test_a_cut_longer_than_the_delivery_timeout_loses_nothing_and_parks_nothing(
    isolated: Isolated, caplog: pytest.LogCaptureFixture
) -> None:
    """Passes fail while the broker is away, and each next pass starts a new producer,
    which cannot reach the broker either: the relay must keep the old one until a new one
    runs (a closed producer's sends fail as errors Kafka does not retry)."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    iso = isolated
    # passes fail and new producers find no broker, again and again
    first, during = over_a_cut(iso, caplog, delivered=50, sent_into_it=100, then=8)
    assert count_status(iso.engine, "outbox", "PARKED") == 0
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} == set(first + during)
    assert first_occurrences_in_order(records)


@both_transports
def test_a_failed_pass_reads_again_the_tails_of_the_topics_it_sent_to_only(
    isolated: Isolated, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass that fails leaves its sends unrecorded, and their tails are read before the
    next pass delivers. Only those: before, every pending message's topic was read again,
    here 120 topics whose messages wait behind a delayed one of their key and were never
    sent (with thousands of such topics the relay read tails for many minutes)."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    iso = isolated
    with Session(iso.engine) as session, session.begin():
        for n in range(120):
            waiting = f"{iso.topic}-waiting-{n}"
            iso.outbox.publish(session, waiting, {"n": n}, key="k",
                               deliver_after=timedelta(hours=1))
            iso.outbox.publish(session, waiting, {"n": n}, key="k")
    first, during = over_a_cut(iso, caplog, delivered=20, sent_into_it=50)
    settled = [r.getMessage() for r in caplog.records if " settled " in r.getMessage()]
    assert settled, "the failed pass's sends were settled"
    assert all(re.search(r"the tails of 1 topic\b", line) for line in settled), settled
    assert "reading the tails of" not in caplog.text
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert Counter(r.message_id for r in records) == Counter(first + during), "each once"
    assert count_status(iso.engine, "outbox", "PENDING") == 120, "the waiting ones wait"


def shards_of(engine: Engine, worker_id: str) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(
            "SELECT count(*) FROM outbox.relay_lease WHERE owner = %s AND expires_at > now()",
            (worker_id,)).scalar_one())


@both_transports
def test_a_relay_cut_off_from_kafka_hands_its_shards_to_a_relay_that_is_not(
    isolated: Isolated
) -> None:
    """Its keys' messages waited for it alone, for as long as the cut lasted; its leases,
    renewed on their own thread, kept its shards from the relay that could deliver them."""
    iso = isolated
    impatient = {"OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS": "2000",
                 "OUTBOX_KAFKA_CONNECT_TIMEOUT_MS": "1000"}
    cut = OutboxProcess(  # as another user, whose packets alone the cut drops
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
         "-m", "outbox", "relay"],
        outbox_env(iso.settings, OUTBOX_WORKER_ID="cut", HOME="/tmp", **impatient))
    other = start_outbox(iso.settings, "relay", OUTBOX_WORKER_ID="other", **impatient)
    keys = [(f"k{i % 20}", i) for i in range(400)]
    try:
        wait_until(lambda: shards_of(iso.engine, "cut") == shards_of(iso.engine, "other")
                   == SHARDS // 2, 60, "the relays to share the shards")
        sent = publish_orders(iso.engine, iso.outbox, iso.topic, keys[:100])
        wait_delivered(iso.engine, "outbox", 100)
        with cut_off(iso.proxy.port, "nobody"):
            sent += publish_orders(iso.engine, iso.outbox, iso.topic, keys[100:300])
            wait_delivered(iso.engine, "outbox", 300, timeout=90)
            assert shards_of(iso.engine, "cut") == 0
        wait_until(lambda: shards_of(iso.engine, "cut") > 0, 60, "the relay to take shards again")
        sent += publish_orders(iso.engine, iso.outbox, iso.topic, keys[300:])
        wait_delivered(iso.engine, "outbox", 400, timeout=60)
    finally:
        for relay in (cut, other):
            relay.send_signal(signal.SIGTERM)
        outputs = [relay.communicate(timeout=60)[0] for relay in (cut, other)]
    assert [cut.returncode, other.returncode] == [0, 0], outputs
    assert "handed them its 32 shards" in outputs[0], outputs[0]
    assert "Kafka answers it again" in outputs[0], outputs[0]
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} == set(sent)
    assert first_occurrences_in_order(records)


@both_transports
def test_abandon_during_a_broker_cut_stops_at_once_and_the_batch_stays_pending(
    isolated: Isolated, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    iso = isolated
    with running_relay(iso.settings) as relay:  # fails if the relay is not gone within 30 s
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 0)])
        wait_delivered(iso.engine, "outbox", 1)
        iso.proxy.cut()
        stuck = publish_orders(iso.engine, iso.outbox, iso.topic,
                               [(f"k{i % 3}", i) for i in range(1, 31)])
        wait_until(lambda: "has not acknowledged" in caplog.text, 20, "the outage to be logged")
        relay.stop(abandon=True)  # the producer would retry for 120 s: a graceful stop waits
    assert "abandoned its batch in flight" in caplog.text
    assert count_status(iso.engine, "outbox", "PENDING") == len(stuck)
    iso.proxy.restore()
    with running_relay(iso.settings):
        wait_delivered(iso.engine, "outbox", 1 + len(stuck), timeout=60)
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} >= set(stuck)


@both_transports
def test_postgres_restart_is_survived(isolated: Isolated,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    iso = isolated
    with running_relay(iso.settings):
        before = publish_orders(iso.engine, iso.outbox, iso.topic,
                                [(f"k{i % 5}", i) for i in range(50)])
        wait_delivered(iso.engine, "outbox", 50)
        devservices.stop_postgres(iso.services)
        devservices.start_postgres(iso.services, durable=False)
        after = publish_orders(iso.engine, iso.outbox, iso.topic,
                               [(f"k{i % 5}", i) for i in range(50, 100)])
        wait_delivered(iso.engine, "outbox", 100, timeout=60)
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} == set(before + after)
    assert first_occurrences_in_order(records)
    assert "paused" in caplog.text or "cannot renew" in caplog.text


def test_a_relay_whose_sessions_are_ended_again_and_again_logs_no_traceback(
    isolated: Isolated
) -> None:
    """``pg_terminate_backend`` on the relay's fetching session, ten times: its batches are
    read on the driver's cursor, so SQLAlchemy did not see its connection go, rolled it back
    on its way to the pool and logged ``Exception during reset`` with two tracebacks."""
    iso = isolated
    url = make_url(iso.settings.database_url).update_query_dict(
        {"application_name": "relay-under-test"})
    relay = start_outbox(iso.settings, "relay",
                         OUTBOX_DATABASE_URL=url.render_as_string(hide_password=False))
    sent: list[int] = []
    try:
        with iso.engine.connect() as admin:
            for round_ in range(10):
                sent += publish_orders(iso.engine, iso.outbox, iso.topic,
                                       [(f"k{i % 7}", i) for i in range(round_ * 50,
                                                                         round_ * 50 + 50)])
                time.sleep(0.5)
                admin.execute(text(  # the session that reads a range of history
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'relay-under-test' "
                    "AND strpos(query, 'once a batch was read from a range') > 0"))
                admin.commit()
        wait_delivered(iso.engine, "outbox", len(sent), timeout=90)
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=60)
    assert relay.returncode == 0, output
    assert "Traceback" not in output and "Exception during reset" not in output, output
    records = read_topic(iso.settings.kafka_bootstrap, iso.topic)
    assert {r.message_id for r in records} == set(sent)
    assert first_occurrences_in_order(records)


@both_transports
def test_permanently_rejected_message_is_parked_and_other_keys_flow(
    engine: Engine, settings: Settings, schema: str, topic: str
) -> None:
    strict = settings.model_copy(update={"kafka_max_request_size": 20_000,
                                         "relay_max_attempts": 3})
    outbox = Outbox(settings=strict)
    with Session(engine) as session, session.begin():
        too_big = outbox.publish(session, topic, b"x" * 50_000, key="a")
        after_it = outbox.publish(session, topic, b"small", key="a")
        other = outbox.publish(session, topic, b"small", key="b")
    with running_relay(strict):
        wait_delivered(engine, schema, 2)
        wait_until(lambda: count_status(engine, schema, "PARKED") == 1, 20, "parking")
        with engine.connect() as conn:
            row = conn.execute(text(
                f"SELECT attempts, last_error FROM {schema}.message_state WHERE id = :id"),
                {"id": too_big}).one()
            parked_op = conn.execute(text(
                f"SELECT detail FROM {schema}.op_record WHERE message_id = :id "
                f"AND action = 'PARKED'"), {"id": too_big}).scalar_one()
        assert row.attempts == 3
        assert "MessageSizeTooLarge" in row.last_error and "MessageSizeTooLarge" in parked_op
        # kafka-python's text names its own max_request_size, librdkafka's none: the
        # reason names the setting (and the broker's limit) an operator can change
        assert row.last_error.endswith(" (the record is larger than OUTBOX_KAFKA_MAX_REQUEST_"
                                       "SIZE, 20000 bytes, or the broker's message.max.bytes)"), \
            row.last_error
        resumed = run_outbox(strict, "resume", str(too_big))
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed message {too_big} (was PARKED)" in resumed.stdout
        wait_until(lambda: _ops(engine, schema, too_big) == ["PARKED", "RESUMED", "PARKED"],
                   20, "the resumed message to be tried and parked again")
    delivered = {r.message_id for r in read_topic(settings.kafka_bootstrap, topic)}
    assert delivered == {after_it, other}


def test_only_permanent_rejections_count_towards_parking(
    engine: Engine, outbox: Outbox, schema: str, topic: str
) -> None:
    """OUTBOX_RELAY_MAX_ATTEMPTS counts permanent rejections (docs/configuration.md). The
    retriable failures a relay records while the broker is away, and rejections of a record
    sent beside a bad one (recorded as retriable, see Relay._settle), must not bring a
    message's first rejection of its own closer to parking."""
    with Session(engine) as session, session.begin():
        message_id = outbox.publish(session, topic, b"x", key="k")

    def fail(permanent: bool) -> list[tuple[int, str]]:
        failure = store.Failure(message_id, "permanent" if permanent else "retriable", permanent)
        with engine.begin() as conn:
            return store.record_failures(conn, schema, "test", [failure], max_attempts=3)

    assert [fail(permanent=False) for _ in range(5)] == [[]] * 5
    assert [fail(permanent=True) for _ in range(3)] == [[], [], [(message_id, topic)]]
    with engine.connect() as conn:
        row = conn.execute(text(f"SELECT attempts, last_error FROM {schema}.pending "
                                f"WHERE message_id = :id"), {"id": message_id}).one()
    assert tuple(row) == (3, "permanent")


@both_transports
def test_a_refused_message_holds_its_key_back_in_the_batches_sent_behind_it(
    engine: Engine, settings: Settings, schema: str, topic: str
) -> None:
    """A record the producer refuses before sending (too large) holds back the later records
    of its key also in the batches already fetched behind it, not only in its own: until it
    is parked they stay pending, then they go out in id order."""
    strict = settings.model_copy(update={"kafka_max_request_size": 20_000,
                                         "relay_max_attempts": 3, "relay_batch_size": 3})
    outbox = Outbox(settings=strict)
    with Session(engine) as session, session.begin():
        too_big = outbox.publish(session, topic, b"x" * 50_000, key="a")
        behind = [outbox.publish(session, topic, b"small", key="a") for _ in range(30)]
    with running_relay(strict):
        wait_delivered(engine, schema, len(behind), timeout=60)
    assert ids_with_status(engine, schema, "PARKED") == [too_big]
    records = read_topic(settings.kafka_bootstrap, topic)
    assert [r.message_id for r in records] == behind, "in id order, each once"


def _ops(engine: Engine, schema: str, message_id: int) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            f"SELECT action FROM {schema}.op_record WHERE message_id = :id ORDER BY id"),
            {"id": message_id}).scalars())


@both_transports
def test_idle_in_transaction_session_does_not_stall_other_deliveries(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.unrelated (id int)"))
    with running_relay(settings), Session(engine) as idle:
        idle.begin()
        idle.execute(text(f"INSERT INTO {schema}.unrelated VALUES (1)"))
        outbox.publish(idle, topic, {"held": True}, key="idle-key")  # never committed
        ids = []
        for n in range(5):
            ids += publish_orders(engine, outbox, topic,
                                  [(f"k{i}", i) for i in range(n * 20, n * 20 + 20)])
        wait_delivered(engine, schema, 100, timeout=20)
        with engine.connect() as conn:
            state = conn.execute(text(
                "SELECT state FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
            )).scalars().all()
        assert state, "the idle transaction stayed open while the others were delivered"
        idle.rollback()
    assert sorted(r.message_id for r in read_topic(settings.kafka_bootstrap, topic)) == ids


def test_an_outage_ended_while_idle_is_said_and_the_next_is_said_again(
    caplog: pytest.LogCaptureFixture
) -> None:
    """An idle relay's database outage was over only at its next delivery: until then the
    relay stayed "in outage", and a broker outage after it was never logged."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso, running_relay(iso.settings):
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 0)])
        wait_delivered(iso.engine, "outbox", 1)
        with iso.engine.connect() as conn:
            conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> "
                "pg_backend_pid() AND backend_type = 'client backend' AND datname = "
                "current_database()"))
        wait_until(lambda: "paused" in caplog.text, 30, "the outage")
        wait_until(lambda: "delivering again" in caplog.text, 30, "the relay to say it is back")
        iso.proxy.cut()
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 1)])
        wait_until(lambda: "has not acknowledged" in caplog.text, 30, "the broker's outage")
        iso.proxy.restore()
        wait_delivered(iso.engine, "outbox", 2, timeout=60)


def paused_gauge() -> float | None:
    return REGISTRY.get_sample_value("outbox_relay_paused")


def test_an_outage_whose_cause_changes_says_so_and_a_gauge_shows_it(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A database blip, and Kafka away before the relay got going again: the log named the
    database alone (the relay then waited on Kafka for as long, silent), and nothing showed
    the relay paused (its /metrics and shard gauge stayed as if it delivered)."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso, running_relay(iso.settings):
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 0)])
        wait_delivered(iso.engine, "outbox", 1)
        assert paused_gauge() == 0
        iso.proxy.cut()
        with iso.engine.connect() as conn:
            conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> "
                "pg_backend_pid() AND backend_type = 'client backend' AND datname = "
                "current_database()"))
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 1)])
        wait_until(lambda: "still paused after" in caplog.text, 60, "the new cause to be said")
        assert paused_gauge() == 1
        lines = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
        assert "OperationalError" in lines[0] and " paused: " in lines[0], lines
        assert "still paused after" in lines[1] and "Kafka" in lines[1], lines
        iso.proxy.restore()
        wait_delivered(iso.engine, "outbox", 2, timeout=60)
        wait_until(lambda: paused_gauge() == 0, 30, "the gauge to say it delivers")


def test_a_relay_that_cannot_renew_its_leases_reports_no_shards() -> None:
    """With its database gone the relay delivers nothing, but its gauge kept the shards it
    last held: OutboxShardsUncovered (fewer than 64 shards owned) could not fire."""
    def owned() -> float | None:
        return REGISTRY.get_sample_value("outbox_relay_owned_shards")

    with isolated_services() as iso, running_relay(iso.settings):
        wait_until(lambda: owned() == SHARDS, 30, "the relay to own every shard")
        devservices.stop_postgres(iso.services)
        try:
            wait_until(lambda: owned() == 0, 30, "the gauge to say no shard is held")
        finally:
            devservices.start_postgres(iso.services, durable=False)
        wait_until(lambda: owned() == SHARDS, 60, "the relay to own every shard again")


def test_database_connections_gone_silent_are_made_again_and_delivery_goes_on(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str,
    services: devservices.Services, caplog: pytest.LogCaptureFixture
) -> None:
    """The network loses the relay's connections to PostgreSQL without a reset (a dropped NAT
    entry): its packets vanish, the server hears nothing. The relay blocked on them until
    the kernel gave up (about 15 minutes), and its worker-id lock's session lived on in the
    server, so the relay, reconnected, was refused as its own twin."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    proxy = TcpProxy(make_url(services.database_url).port or 5432)
    through = settings.model_copy(update={
        "database_url": make_url(services.database_url).set(port=proxy.port)
        .render_as_string(hide_password=False),
        "database_tcp_timeout": 2})
    try:
        with running_relay(through):
            publish_orders(engine, outbox, topic, [(f"k{i % 5}", i) for i in range(50)])
            wait_delivered(engine, schema, 50)
            lost = proxy.client_ports()
            assert len(lost) >= 5, "the relay's connections go through the proxy"
            with silenced(proxy.port, lost):
                publish_orders(engine, outbox, topic, [(f"k{i % 5}", i) for i in range(50, 100)])
                wait_delivered(engine, schema, 100, timeout=60)
    finally:
        proxy.close()
    assert "a session of its own whose connection was lost" in caplog.text
    assert sorted(r.message_id for r in read_topic(settings.kafka_bootstrap, topic)) \
        == list(range(1, 101))


def test_the_server_ends_a_vanished_relays_sessions_as_soon_as_the_relay_gives_up_on_them(
    settings: Settings, schema: str
) -> None:
    """Each session's server side gets the timeouts its client has (OUTBOX_DATABASE_TCP_TIMEOUT
    and the URL's own libpq parameters): a session whose relay vanished lived on for the
    kernel's two hours, holding the relay's worker-id or wake locks (every publish notified)
    and a connection slot."""
    timed = settings.model_copy(update={
        "database_url": settings.database_url + "?keepalives_count=5",
        "database_tcp_timeout": 12})
    names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count",
             "tcp_user_timeout")
    expected = {"tcp_keepalives_idle": "6", "tcp_keepalives_interval": "2",
                "tcp_keepalives_count": "5", "tcp_user_timeout": "12000"}
    made = store.engine(timed.sqlalchemy_url)
    try:
        with made.connect() as conn:
            assert {n: conn.exec_driver_sql(f"SHOW {n}").scalar_one() for n in names} == expected
    finally:
        made.dispose()
    wakeup = Wakeup(timed.sqlalchemy_url, schema)
    try:
        assert {n: wakeup._conn.execute(f"SHOW {n}").fetchone()[0] for n in names} == expected
    finally:
        wakeup.close()


def test_a_batch_whose_recording_failed_is_not_sent_again_before_its_tail_is_read(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    """The recorder's statement fails (its backend ended) while the main loop waits in its
    next statement (behind a lock on ``pending``, as the recorder's statement did): the
    failed batch left the rows in flight at once, so the fetch that followed read its rows
    again and the relay sent every one of them a second time, before the pass ended and
    the tail read could find them in Kafka."""
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 5}", i) for i in range(100)])
    queue_held, release = threading.Event(), threading.Event()

    def hold_the_queue() -> None:  # the relay's next statement on pending waits behind it
        with engine.connect() as conn:
            conn.begin()
            conn.execute(text(f"LOCK TABLE {schema}.pending IN ACCESS EXCLUSIVE MODE"))
            queue_held.set()
            release.wait(30)
            conn.rollback()

    def waiting(statement: str) -> list[int]:
        with engine.connect() as conn:
            return list(conn.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE :statement"), {"statement": statement}).scalars())

    holder = threading.Thread(target=hold_the_queue, daemon=True)
    with engine.connect() as history:
        history.begin()
        history.execute(text(f"LOCK TABLE {schema}.op_record IN EXCLUSIVE MODE"))
        try:
            with running_relay(settings):
                wait_until(lambda: len(read_topic(settings.kafka_bootstrap, topic)) >= 100,
                           60, "every message acknowledged by Kafka")
                wait_until(lambda: waiting("%Close a delivered batch%"), 30,
                           "the recording statement to wait for op_record")
                holder.start()
                wait_until(lambda: len(waiting(f"%{schema}.pending%")) >= 3, 30,
                           "the relay's next statement to queue behind the lock on pending")
                with engine.connect() as conn:
                    conn.execute(text("SELECT pg_terminate_backend(:pid)"),
                                 {"pid": waiting("%Close a delivered batch%")[0]})
                wait_until(queue_held.is_set, 30, "the lock on pending")
                time.sleep(0.5)  # the recorder has failed by now
                release.set()
                history.rollback()
                wait_delivered(engine, schema, 100)
        finally:
            release.set()
            holder.join(30) if holder.ident else None
    assert Counter(r.message_id for r in read_topic(settings.kafka_bootstrap, topic)) \
        == Counter(ids), "each message once"


def read_only_for_a_while(iso: Isolated, caplog: pytest.LogCaptureFixture, paused: str) -> None:
    """The database read-only and every session ended, as after a failover to a standby not
    yet promoted; writable again once the daemon has connected to it (``paused`` logged)."""
    with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        conn.execute(text(f"ALTER DATABASE {database} SET default_transaction_read_only = on"))
        conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> "
            "pg_backend_pid() AND backend_type = 'client backend'"))
    iso.engine.dispose()
    wait_until(lambda: paused in caplog.text, 30, "the daemon to lose its connections")
    time.sleep(3)  # it connects again, to the read-only server, and fails there
    with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SET default_transaction_read_only = off"))
        conn.execute(text(f"ALTER DATABASE {database} RESET default_transaction_read_only"))
    iso.engine.dispose()  # the test's own sessions were read-only too


def test_a_relay_that_reconnected_to_a_read_only_server_delivers_once_it_is_writable(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A failover that lands the relay on a server still read-only (a standby being promoted,
    default_transaction_read_only): its pooled connections kept the read-only sessions they
    were made in, so the relay stayed paused after the server became writable, while its
    lease keeper, which reconnects, kept the shards from every other relay."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso, running_relay(iso.settings):
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 0)])
        wait_delivered(iso.engine, "outbox", 1)
        read_only_for_a_while(iso, caplog, "paused")
        publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 1)])
        wait_delivered(iso.engine, "outbox", 2, timeout=30)


def test_a_sweeper_that_reconnected_to_a_read_only_server_checks_once_it_is_writable(
    caplog: pytest.LogCaptureFixture
) -> None:
    """The sweeper's pooled sessions stayed read-only too, and it logged "reaches PostgreSQL
    again" and "cannot reach PostgreSQL" in turn at each retry: it had only connected."""
    caplog.set_level(logging.WARNING, logger="outbox.sweeper")
    with isolated_services() as iso:
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1})
        orders = Outbox(settings=fast, producer_group="orders")

        def checked_back() -> None:
            with Session(iso.engine) as session, session.begin():
                prepared = orders.prepare(session, iso.topic, {"order": 1})
            wait_until(lambda: _resolution(iso.engine, prepared) == "COMMIT", 30,
                       "the check-back")

        with running(Sweeper(fast, {"orders": lambda message, conn: "COMMIT"}), "sweeper"):
            checked_back()
            read_only_for_a_while(iso, caplog, "cannot reach PostgreSQL")
            checked_back()
    assert caplog.text.count("reaches PostgreSQL again") <= 1, caplog.text


def test_a_sweeper_whose_check_cannot_be_cancelled_goes_on(
    caplog: pytest.LogCaptureFixture
) -> None:
    """At a check's deadline the sweeper cancels its statement, over a new connection. With
    the server answering no new connection that failed (psycopg's own error, not
    SQLAlchemy's) and ended the sweeper."""
    caplog.set_level(logging.WARNING, logger="outbox.sweeper")
    with isolated_services() as iso:
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1,
            "checker_timeout": 1.0, "database_tcp_timeout": 2})
        checking = threading.Event()

        def slow(message: object, conn: Connection) -> str:
            if not checking.is_set():  # the first check outlives its deadline
                checking.set()
                conn.execute(text("SELECT pg_sleep(5)"))
            return "COMMIT"

        port = make_url(iso.services.database_url).port or 5432
        with Session(iso.engine) as session, session.begin():
            prepared = Outbox(settings=fast, producer_group="orders").prepare(
                session, iso.topic, {"order": 1})
        with running(Sweeper(fast, {"orders": slow}), "sweeper"):
            wait_until(checking.is_set, 30, "the check to start")
            with unanswered_connects(port):  # the cancel's own connection among them
                wait_until(lambda: "counted as inconclusive" in caplog.text, 30,
                           "the check's deadline")
                time.sleep(2)
            wait_until(lambda: _resolution(iso.engine, prepared) == "COMMIT", 60,
                       "the check-back, once the server answers")


def _resolution(engine: Engine, message_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT resolution FROM outbox.message_state "
                                     "WHERE id = :id"), {"id": message_id}).scalar_one())


def test_a_server_that_ends_idle_sessions_leaves_the_relays_alone(
    caplog: pytest.LogCaptureFixture
) -> None:
    """``idle_session_timeout`` set on the role by a DBA ended the relay's sessions that are
    idle by design (its LISTEN connection, its worker-id lock's), so each quiet spell was
    an outage: the pass failed and every tail was read again."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso:
        with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ALTER ROLE CURRENT_USER SET idle_session_timeout = '1s'"))
        iso.engine.dispose()
        with running_relay(iso.settings):
            publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 0)])
            wait_delivered(iso.engine, "outbox", 1)
            time.sleep(4)  # a quiet spell, longer than the timeout
            publish_orders(iso.engine, iso.outbox, iso.topic, [("k", 1)])
            wait_delivered(iso.engine, "outbox", 2)
        assert "paused" not in caplog.text, caplog.text


def test_a_takeover_of_a_long_backlog_of_distinct_keys_fits_a_roles_temp_file_limit(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A takeover groups the unsettled shards' pending messages by key. In one statement, a
    backlog of 60,000 keys spilled to disk past the role's ``temp_file_limit`` (53400): the
    read failed at every retry, as an outage, and the relay delivered nothing."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso:
        with iso.engine.begin() as conn:
            conn.execute(text(f"""
                WITH written AS (
                    INSERT INTO outbox.message (topic, key, payload, content_type, shard)
                    SELECT '{iso.topic}', convert_to('k' || i, 'UTF8'), 'x', 'text/plain',
                           i % {SHARDS}
                    FROM generate_series(1, 60000) AS i
                    RETURNING id, topic, key, shard, created_at)
                INSERT INTO outbox.pending
                    (message_id, shard, topic, key, producer_group, status, resolution,
                     created_at)
                SELECT id, shard, topic, key, 'default', 'PENDING', 'COMMIT', created_at
                FROM written"""))
            conn.execute(text("UPDATE outbox.relay_lease SET clean = false"))  # a lost relay's
            conn.execute(text("ALTER ROLE CURRENT_USER SET work_mem = '1MB'"))
            conn.execute(text("ALTER ROLE CURRENT_USER SET temp_file_limit = '1MB'"))
        iso.engine.dispose()
        observer = create_engine(iso.engine.url, connect_args={  # the test's own count
            "options": "-c temp_file_limit=-1 -c work_mem=64MB"})
        try:
            with running_relay(iso.settings):
                wait_delivered(observer, "outbox", 60_000, timeout=120)
        finally:
            observer.dispose()
        assert "temp_file_limit" not in caplog.text, caplog.text


def test_a_statement_timeout_on_the_role_cancels_none_of_the_daemons_statements(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A DBA's ``statement_timeout`` on the role cancelled the relay's fetch and recording of
    a batch (and a takeover's read of a backlog, retention's drop) at each try: delivery
    stopped, retried for ever as an outage. The outbox's sessions bound their own
    statements (a check-back by ``checker_timeout``)."""
    caplog.set_level(logging.WARNING)
    with isolated_services() as iso:
        with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            # far above a SET's time even on a loaded machine, far below a 10,000-row batch's
            conn.execute(text("ALTER ROLE CURRENT_USER SET statement_timeout = '25ms'"))
        iso.engine.dispose()
        own = create_engine(iso.engine.url, connect_args={"options": "-c statement_timeout=0"})
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1})
        large = iso.settings.model_copy(update={"relay_batch_size": 10_000})
        try:
            publish_orders(own, iso.outbox, iso.topic,
                           [(f"k{i % 7}", i) for i in range(10_000)])
            with Session(own) as session, session.begin():
                Outbox(settings=fast, producer_group="orders").prepare(
                    session, iso.topic, {"order": 1})
            with running_relay(large), \
                    running(Sweeper(fast, {"orders": lambda message, conn: "COMMIT"}), "sweeper"):
                wait_delivered(own, "outbox", 10_001, timeout=60)
        finally:
            own.dispose()
    assert "paused" not in caplog.text and "cannot reach" not in caplog.text, caplog.text


#: Role defaults that change what a statement means or how its answer reads, each of which
#: stopped a daemon or a command (the sweeper's claims, the relay's fetch and takeover,
#: retention, ``outbox discarded``) or made it fail passes as outages.
HOSTILE_DEFAULTS = {"DateStyle": "SQL, DMY", "IntervalStyle": "sql_standard",
                    "standard_conforming_strings": "off",
                    "default_transaction_isolation": "serializable",
                    "default_transaction_deferrable": "on", "client_encoding": "LATIN1"}


def test_role_defaults_that_change_what_statements_mean_stop_none_of_the_outbox(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with isolated_services() as iso:
        with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for name, value in HOSTILE_DEFAULTS.items():
                conn.execute(text(f"ALTER ROLE CURRENT_USER SET {name} = '{value}'"))
        iso.engine.dispose()
        # the application's own sessions in UTF-8 (its own choice to make)
        app = create_engine(iso.engine.url, connect_args={"client_encoding": "UTF8"})
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1})
        try:
            publish_orders(app, iso.outbox, iso.topic, [(f"k{i % 3}", i) for i in range(30)])
            with Session(app) as session, session.begin():
                Outbox(settings=fast, producer_group="orders").prepare(
                    session, iso.topic, {"order": 1}, headers={"язык": "да"})
                iso.outbox.publish(session, iso.topic, {"order": 2}, key="later",
                                   deliver_at=datetime.now(UTC) + timedelta(seconds=1))
            with running_relay(iso.settings), \
                    running(Sweeper(fast, {"orders": lambda message, conn: "COMMIT"}), "sweeper"):
                wait_delivered(app, "outbox", 32)
            for command in (["status"], ["discarded"], ["prune"], ["db", "upgrade"]):
                result = run_outbox(iso.settings, *command)
                assert result.returncode == 0, (command, result.stderr)
                assert "Traceback" not in result.stderr, result.stderr
            with running_relay(iso.settings):  # a takeover's read of the tails, by the ids
                publish_orders(app, iso.outbox, iso.topic, [("k0", 30)])
                wait_delivered(app, "outbox", 33)
            records = read_topic(iso.services.kafka_bootstrap, iso.topic)
        finally:
            app.dispose()
    assert sorted(r.message_id or 0 for r in records) == list(range(1, 34))
    assert "paused" not in caplog.text and "cannot reach" not in caplog.text, caplog.text


def test_a_checker_slower_than_the_roles_idle_in_transaction_timeout_is_heard(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A checker runs inside the check's transaction; while it works (an HTTP call, a
    computation) the session is idle in that transaction. A DBA's
    ``idle_in_transaction_session_timeout`` on the sweeper's role ended the session under
    the checker, and the check failed however the checker answered."""
    caplog.set_level(logging.WARNING, logger="outbox.sweeper")
    with isolated_services() as iso:
        with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(
                "ALTER ROLE CURRENT_USER SET idle_in_transaction_session_timeout = '200ms'"))
        iso.engine.dispose()
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1,
            "checker_timeout": 5.0})

        def thinking(message: object, conn: Connection) -> str:
            time.sleep(0.6)  # three times the role's timeout, well inside checker_timeout
            return "COMMIT"

        with Session(iso.engine) as session, session.begin():
            prepared = Outbox(settings=fast, producer_group="orders").prepare(
                session, iso.topic, {"order": 1})
        with running(Sweeper(fast, {"orders": thinking}), "sweeper"):
            wait_until(lambda: _resolution(iso.engine, prepared) == "COMMIT", 20,
                       "the check-back")
    assert "inconclusive" not in caplog.text and "failed" not in caplog.text, caplog.text


def test_a_lock_timeout_on_the_role_makes_no_outage_of_a_wait_behind_a_lock(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A DBA's ``lock_timeout`` on the relay's role made its wait behind a lock an upgrade
    held on ``pending`` for a moment an outage: the pass ended, to start again with a
    backoff and a new read of the tails."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with isolated_services() as iso:
        with iso.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ALTER ROLE CURRENT_USER SET lock_timeout = '50ms'"))
        iso.engine.dispose()
        publish_orders(iso.engine, iso.outbox, iso.topic, [(f"k{i % 3}", i) for i in range(30)])
        with iso.engine.connect() as conn, conn.begin():
            conn.execute(text("SET LOCAL lock_timeout = 0"))
            conn.execute(text("LOCK TABLE outbox.pending IN EXCLUSIVE MODE"))
            with running_relay(iso.settings):
                time.sleep(1.5)  # the relay starts, and waits behind the lock
                conn.commit()
                wait_delivered(iso.engine, "outbox", 30)
    assert "paused" not in caplog.text and "cannot reach" not in caplog.text, caplog.text


def test_a_checked_connection_goes_back_to_the_pool_with_the_sessions_settings() -> None:
    """DISCARD ALL after each check also dropped what the sweeper's sessions set (JIT off,
    no statement or idle timeouts, the server's TCP timeouts): the pooled connection went on
    with the role's defaults."""
    with isolated_services() as iso:
        fast = iso.settings.model_copy(update={
            "transaction_timeout": 0.2, "check_interval": 0.1, "sweep_poll_interval": 0.1,
            "sweep_concurrency": 1})
        seen: list[str] = []

        def noting(message: object, conn: Connection) -> str:
            seen.append(str(conn.execute(text("SHOW jit")).scalar_one()))
            return "COMMIT"

        orders = Outbox(settings=fast, producer_group="orders")
        with running(Sweeper(fast, {"orders": noting}), "sweeper"):
            for n in range(6):
                with Session(iso.engine) as session, session.begin():
                    prepared = orders.prepare(session, iso.topic, {"order": n})
                wait_until(lambda m=prepared: _resolution(iso.engine, m) == "COMMIT", 30,
                           "the check-back")
    assert seen == ["off"] * 6


def test_a_database_url_naming_several_hosts_reaches_the_one_that_answers(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str,
    services: devservices.Services
) -> None:
    """A URL naming a standby and the primary (libpq tries each host in turn): every engine
    read it, but the relay's LISTEN connection was made from the URL as text, which libpq
    read as one host named ``127.0.0.1:PORT``; each pass failed, for ever."""
    url = make_url(services.database_url)
    hosts = f"host=127.0.0.1:{devservices.free_port()}&host=127.0.0.1:{url.port}"
    several = settings.model_copy(update={"database_url": (
        f"postgresql://{devservices.DB_USER}:{devservices.DB_PASSWORD}@/{url.database}"
        f"?{hosts}")})
    with running_relay(several):
        publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(20)])
        wait_delivered(engine, schema, 20)


def test_a_relay_whose_leases_lapsed_for_a_moment_delivers_as_soon_as_they_are_renewed(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    """While its leases are past their time (a renewal held up), a relay delivers nothing and
    waits. The renewal that brought them back, the same shards, did not wake it: it slept
    out its whole poll interval (a minute, for a relay that counts on notifications)."""
    patient = settings.model_copy(update={"relay_poll_interval": 60, "relay_lease_seconds": 3})
    with running_relay(patient):
        publish_orders(engine, outbox, topic, [("k", 0)])
        wait_delivered(engine, schema, 1)
        with engine.connect() as conn, conn.begin():
            conn.execute(text(f"LOCK TABLE {schema}.relay_lease IN EXCLUSIVE MODE"))
            time.sleep(4)  # the renewal waits past 80% of the lease: the leases lapse
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 2, timeout=15)


def test_an_error_of_the_statement_itself_is_said_once_as_an_error_with_its_traceback(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """An index's size limit (revision 0024's held keys), a value a column refuses, a
    trigger's exception: a retry meets each again. The relay said "paused: ...; retrying
    with backoff", as of a database away, and nothing pointed at the statement."""
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    with engine.begin() as conn:
        conn.execute(text(
            f"CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'refused by the test'; END $$"))
        conn.execute(text(f"CREATE TRIGGER refuse BEFORE INSERT ON {schema}.op_record "
                          f"FOR EACH ROW EXECUTE FUNCTION {schema}.refuse()"))
    publish_orders(engine, outbox, topic, [("k", 1)])
    with running_relay(settings):
        wait_until(lambda: "refused by the test" in caplog.text, 30, "the statement to fail")
        time.sleep(2)  # passes meet it again
        said = [r for r in caplog.records if "refused by the test" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR, said
        assert said[0].exc_info and "the statement itself failed" in said[0].getMessage()
        with engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER refuse ON {schema}.op_record"))
        wait_delivered(engine, schema, 1, timeout=60)
        wait_until(lambda: "delivering again" in caplog.text, 30, "the relay to say so")


def test_a_lease_keeper_whose_session_ended_renews_on_a_new_one_at_once(
    caplog: pytest.LogCaptureFixture
) -> None:
    """After a PostgreSQL restart the relay said it delivered again; then the lease keeper,
    on the connection it kept across ticks, said it could not renew its leases, set its
    shard gauge to 0 (a false OutboxShardsUncovered alert) and waited a third of a lease
    before trying a new connection."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    with isolated_services() as iso, running_relay(iso.settings):
        wait_until(lambda: REGISTRY.get_sample_value("outbox_relay_owned_shards") == SHARDS,
                   30, "the relay to own every shard")
        with iso.engine.connect() as conn:
            ended = conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE pid <> "
                "pg_backend_pid() AND backend_type = 'client backend' AND datname = "
                "current_database()")).scalar_one()
        assert ended >= 2
        time.sleep(iso.settings.relay_lease_seconds)  # three of the keeper's ticks
        assert "cannot renew its leases" not in caplog.text
        assert REGISTRY.get_sample_value("outbox_relay_owned_shards") == SHARDS
