"""The check-back sweeper: UNKNOWN messages are asked about, at most check_max times (§3.6)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, Row, create_engine, make_url, text
from sqlalchemy.orm import Session

from outbox import Message, Outbox, store
from outbox.checkers import Checker
from outbox.dev import services as devservices
from outbox.dev.services import free_port
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.relay.sweeper import Sweeper
from outbox.settings import Settings
from tests.conftest import publish_orders, running, running_relay, wait_delivered, wait_until
from tests.processes import OutboxProcess, outbox_env, run_outbox, start_outbox
from tests.tcp_proxy import TcpProxy

GROUP = "orders"


@pytest.fixture
def fast(settings: Settings) -> Settings:
    """RocketMQ's check-back, with intervals short enough for tests (check_max stays 15)."""
    return settings.model_copy(update={
        "transaction_timeout": 0.2, "check_interval": 0.1, "checker_timeout": 2.0,
        "sweep_poll_interval": 0.1,
    })


@pytest.fixture
def orders(fast: Settings) -> Outbox:
    return Outbox(settings=fast, producer_group=GROUP)


@contextmanager
def sweeping(settings: Settings, checkers: Mapping[str, Checker] | None = None,
             **overrides: Any) -> Iterator[Sweeper]:
    """A sweeper running in a thread; stopping it waits for the checks in flight."""
    with running(Sweeper(settings.model_copy(update=overrides), checkers), "sweeper") as sweeper:
        yield sweeper


def prepare(engine: Engine, outbox: Outbox, topic: str = "orders", payload: object = "x",
            key: str | bytes | None = None) -> int:
    with Session(engine) as session, session.begin():
        return outbox.prepare(session, topic, payload, key=key)


def row(engine: Engine, schema: str, message_id: int) -> Row[Any]:
    with engine.connect() as conn:
        return conn.execute(text(
            f"SELECT resolution, status, check_count FROM {schema}.message_state WHERE id = :id"),
            {"id": message_id}).one()


def ops(engine: Engine, schema: str, message_id: int) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [(r.action, r.detail) for r in conn.execute(text(
            f"SELECT action, detail FROM {schema}.op_record WHERE message_id = :id ORDER BY id"),
            {"id": message_id})]


def checks_open(engine: Engine, settings: Settings, state: str = "idle in transaction"
                ) -> int:
    """The sweeper's sessions in ``state`` for over a second: checks in hand (a Python
    checker's idle in its transaction, a SQL checker's statement active)."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name "
            "AND state = :state AND now() - state_change > interval '1s'"),
            {"name": f"outbox-sweeper:{settings.worker_id}"[:63], "state": state}).scalar_one())


def wait_status(engine: Engine, schema: str, message_id: int, status: str,
                timeout: float = 30) -> None:
    wait_until(lambda: row(engine, schema, message_id).status == status, timeout,
               f"message {message_id} to be {status}")


def wait_resolution(engine: Engine, schema: str, message_id: int, resolution: str,
                    timeout: float = 30) -> None:
    wait_until(lambda: row(engine, schema, message_id).resolution == resolution, timeout,
               f"message {message_id} to be resolved {resolution}")


def answering(answer: str | None, calls: list[int] | None = None) -> Checker:
    def checker(message: Message, conn: Connection) -> str | None:
        if calls is not None:
            calls.append(message.id)
        return answer

    return checker


def answering_late(answer: str, seconds: float = 0.6) -> Checker:
    """A checker that answers ``answer`` after ``seconds`` (past the tests' timeouts)."""
    def checker(message: Message, conn: Connection) -> str:
        time.sleep(seconds)
        return answer

    return checker


def discarded_metric(group: str) -> float:
    return REGISTRY.get_sample_value("outbox_messages_discarded_total",
                                     {"producer_group": group}) or 0.0


# --- each resolution -----------------------------------------------------------------------

def test_checker_commit_hands_the_message_to_the_relay(
    engine: Engine, orders: Outbox, fast: Settings, topic: str, schema: str, relay: Relay
) -> None:
    message_id = prepare(engine, orders, topic, {"order": 1}, key="a")
    with sweeping(fast, {GROUP: answering("COMMIT")}):
        wait_delivered(engine, schema, 1)
    assert [r.message_id for r in read_topic(fast.kafka_bootstrap, topic)] == [message_id]
    # A finished row keeps no check count (its pending row is gone): the view shows none.
    assert tuple(row(engine, schema, message_id)) == ("COMMIT", "DELIVERED", None)


def test_checker_rollback_closes_the_message_and_it_is_never_delivered(
    engine: Engine, orders: Outbox, fast: Settings, topic: str, schema: str, relay: Relay
) -> None:
    rolled_back = prepare(engine, orders, topic, {"order": 1}, key="a")
    with sweeping(fast, {GROUP: answering("ROLLBACK")}):
        wait_status(engine, schema, rolled_back, "ROLLED_BACK")
    committed = publish_orders(engine, orders, topic, [("a", 2)])
    wait_delivered(engine, schema, 1)

    assert [r.message_id for r in read_topic(fast.kafka_bootstrap, topic)] == committed
    assert ops(engine, schema, rolled_back) == [
        ("ROLLED_BACK", "check-back 1: checker answered ROLLBACK")]


def test_unknown_answers_are_checked_exactly_check_max_times_then_discarded(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert fast.check_max == 15
    calls: list[int] = []
    before = discarded_metric(GROUP)
    message_id = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
            sweeping(fast, {GROUP: answering("UNKNOWN", calls)}):
        wait_status(engine, schema, message_id, "DISCARDED")
        time.sleep(10 * fast.check_interval)  # time enough for a 16th check, were it made

    assert calls == [message_id] * 15
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "DISCARDED", 15)
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", "15 inconclusive check-backs, the last: checker answered UNKNOWN")]
    assert discarded_metric(GROUP) == before + 1
    assert [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()] == [
        f"message {message_id} (producer group 'orders') discarded after 15 inconclusive "
        f"check-backs; `outbox resume {message_id}` checks it again"]


def test_a_checker_that_raises_counts_as_inconclusive(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    def broken(message: Message, conn: Connection) -> str:
        raise ConnectionError("inventory service unreachable")

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: broken}, check_max=3):
        wait_status(engine, schema, message_id, "DISCARDED")
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", "3 inconclusive check-backs, the last: checker raised ConnectionError: "
                      "inventory service unreachable")]


def test_a_checker_whose_own_database_is_down_counts_as_inconclusive(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """A Python checker asking another database (the business one) that does not answer
    raised the same OperationalError as a lost outbox connection: taken for the outbox's own
    trouble, the check was never counted, and the message was checked again for ever."""
    elsewhere = create_engine(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/shop")

    def asks_elsewhere(message: Message, conn: Connection) -> str:
        with elsewhere.connect() as shop:
            return str(shop.execute(text("SELECT 'COMMIT'")).scalar_one())

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: asks_elsewhere}, check_max=2):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=20)
    [(action, detail)] = ops(engine, schema, message_id)
    assert (action, detail.split(":")[0]) == (
        "DISCARDED", "2 inconclusive check-backs, the last"), detail
    assert "checker raised OperationalError: " in detail and "refused" in detail, detail


def test_a_checker_whose_error_postgresql_cannot_store_is_counted_all_the_same(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """An error's text holding a NUL or a lone surrogate (an echoed binary reply) could not
    be recorded: the check was never counted, and the message was checked again for ever."""
    def garbled(message: Message, conn: Connection) -> str:
        raise ValueError("reply b'\x00\x01' then \ud800")

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: garbled}, check_max=2):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=20)
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", "2 inconclusive check-backs, the last: checker raised ValueError: "
                      "reply b'\ufffd\x01' then \ufffd")]


def test_a_check_that_ended_during_a_database_outage_is_not_counted_as_timed_out(
    services: devservices.Services, engine: Engine, orders: Outbox, fast: Settings,
    schema: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A checker answered COMMIT while PostgreSQL was away, so its answer could not be
    recorded. Back from the outage, the sweeper counted that finished check as timed out (it
    was still listed as running): with one check left, a committed message was discarded."""
    proxy = TcpProxy(make_url(services.database_url).port or 5432)
    through = fast.model_copy(update={"database_url": make_url(services.database_url).set(
        port=proxy.port).render_as_string(hide_password=False), "check_max": 1})
    asked = threading.Event()

    def slow_commit(message: Message, conn: Connection) -> str:
        asked.set()
        time.sleep(1.0)
        return "COMMIT"

    message_id = prepare(engine, orders)
    try:
        with sweeping(through, {GROUP: slow_commit}):
            assert asked.wait(15), "the check to start"
            proxy.cut()
            time.sleep(through.checker_timeout + 1)  # past the check's deadline
            proxy.restore()
            wait_resolution(engine, schema, message_id, "COMMIT", timeout=30)
    finally:
        proxy.close()
    assert "timed out" not in caplog.text, caplog.text


@pytest.mark.parametrize(("answer", "check_max"), [("ROLLBACK", 15), ("UNKNOWN", 1)],
                         ids=["rolled-back", "discarded"])
def test_a_check_back_that_frees_a_key_wakes_the_relay(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, topic: str, answer: str,
    check_max: int
) -> None:
    """An UNKNOWN message holds back the later messages of its key. Rolled back or discarded
    by its check-back, it freed them, but only a COMMIT woke the relay: they waited for its
    next poll (here 30 s; `relay_poll_interval` may be an hour)."""
    with running_relay(fast.model_copy(update={"relay_poll_interval": 30})):
        time.sleep(1)  # idle: asleep on its shards
        prepare(engine, orders, topic, key="k")
        with Session(engine) as session, session.begin():
            orders.publish(session, topic, "behind", key="k")
        with sweeping(fast, {GROUP: lambda message, conn: answer}, check_max=check_max):
            wait_delivered(engine, schema, 1, timeout=10)


def test_a_timeout_the_database_did_not_take_is_not_logged_as_counted(
    services: devservices.Services, engine: Engine, orders: Outbox, fast: Settings,
    schema: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A check timed out while PostgreSQL was away: the sweeper logged `counted as
    inconclusive` before it tried to record that, and the record failed. The message was
    not counted (rightly: it was checked again), but the log said it was."""
    proxy = TcpProxy(make_url(services.database_url).port or 5432)
    through = fast.model_copy(update={"database_url": make_url(services.database_url).set(
        port=proxy.port).render_as_string(hide_password=False),
        "sweep_poll_interval": 30})  # the loop sleeps until the check's deadline
    calls: list[float] = []

    def stuck_once(message: Message, conn: Connection) -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(through.checker_timeout + 1)
        return "COMMIT"

    message_id = prepare(engine, orders)
    try:
        with sweeping(through, {GROUP: stuck_once}):
            wait_until(lambda: bool(calls), 15, "the check to start")
            proxy.cut()
            wait_until(lambda: "timed out" in caplog.text, 10, "the check to time out")
            proxy.restore()
            wait_resolution(engine, schema, message_id, "COMMIT", timeout=30)
    finally:
        proxy.close()
    assert "counted as inconclusive" not in caplog.text, caplog.text
    assert f"message {message_id} (producer group {GROUP!r}): checker timed out after 2 s; " \
        "not counted (PostgreSQL did not take it): checked again" in caplog.text, caplog.text
    # The timeout not counted: the COMMIT decided it, late (uncounted) or checked again.
    assert row(engine, schema, message_id).check_count in (0, 1)


def _with_block(conn: Connection) -> None:
    with conn:
        conn.execute(text("SELECT 'paid'"))


LENT_CONNECTION_ENDS = {
    "with-block": _with_block,
    "close": lambda conn: conn.close(),
    "invalidate": lambda conn: conn.invalidate(),
    "driver-close": lambda conn: conn.connection.driver_connection.close(),
}


@pytest.mark.parametrize("end", LENT_CONNECTION_ENDS.values(), ids=LENT_CONNECTION_ENDS.keys())
def test_a_checker_that_ends_the_connection_it_was_lent_is_answered_and_leaves_no_session(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture, end: Any,
) -> None:
    """A checker that answered after closing its connection (``with conn:``) had its answer
    lost: cleaning up the closed connection raised, and the check was retried for ever,
    uncounted, its key held back. The answer stands; the session it may have left
    something on (here an advisory lock) is ended, not handed out again."""
    def paid(message: Message, conn: Connection) -> str:
        conn.execute(text("SELECT pg_advisory_lock(4343)"))
        end(conn)
        return "COMMIT"

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: paid}, check_max=3):
        wait_resolution(engine, schema, message_id, "COMMIT", timeout=15)
        held = advisory_locks(engine, 4343)
    assert held == 0
    assert row(engine, schema, message_id).resolution == "COMMIT"
    assert "check-back failed" not in caplog.text, caplog.text


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def _closes_then_reads(message: Message, conn: Connection) -> str:
    conn.close()
    return str(conn.execute(text("SELECT 'COMMIT'")).scalar_one())


def _closes_its_session_then_reads(message: Message, conn: Connection) -> str:
    conn.connection.driver_connection.close()
    return str(conn.execute(text("SELECT 'COMMIT'")).scalar_one())


def _raises_unprintable(message: Message, conn: Connection) -> str:
    raise Unprintable


@pytest.mark.parametrize(("checker", "raised"), [
    (_closes_then_reads, "ResourceClosedError: This Connection is closed"),
    # (its session's loss was taken for an outage: never counted, checked for ever)
    (_closes_its_session_then_reads, "OperationalError: the connection is closed"),
    (_raises_unprintable, "Unprintable: (its text is unreadable: str() raised RuntimeError)"),
], ids=["closes-then-reads", "closes-its-session-then-reads", "unprintable-error"])
def test_a_checker_that_misbehaves_counts_as_inconclusive(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture, checker: Checker, raised: str,
) -> None:
    """Cleaning up after a checker that closed its connection, or printing an error whose
    str() fails, raised again: the check was never counted and was retried for ever."""
    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: checker}, check_max=2):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=20)
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", f"2 inconclusive check-backs, the last: checker raised {raised}")]
    assert "check-back failed" not in caplog.text, caplog.text


@pytest.mark.parametrize("raised", [SystemExit(3), asyncio.CancelledError("cancelled"),
                                    KeyboardInterrupt("interrupted")],
                         ids=["sys.exit", "asyncio-cancelled", "keyboard-interrupt"])
def test_a_checker_that_raises_a_base_exception_counts_as_inconclusive(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, raised: BaseException
) -> None:
    """Only SystemExit was caught: a checker that ran a coroutine cancelled under it (an
    ``asyncio.CancelledError``, no Exception) was never counted, and its message was checked
    again every few seconds for ever, its key held back behind it."""
    def raises(message: Message, conn: Connection) -> str:
        raise raised

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: raises}, check_max=2):
        wait_status(engine, schema, message_id, "DISCARDED", timeout=20)
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", f"2 inconclusive check-backs, the last: checker raised "
                      f"{type(raised).__name__}: {raised}")]


def discarded_by_timeouts(engine: Engine, orders: Outbox, fast: Settings, schema: str,
                          caplog: pytest.LogCaptureFixture, answer: str, check_max: int) -> int:
    """A message whose checks all time out (0.2 s), each answering ``answer`` 0.6 s after it
    began, until ``check_max`` of them discard it; its id once the last answer came."""
    message_id = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
            sweeping(fast, {GROUP: answering_late(answer)}, check_max=check_max,
                     checker_timeout=0.2):
        wait_status(engine, schema, message_id, "DISCARDED")
        if answer != "UNKNOWN":
            wait_until(lambda: "its checker answered" in caplog.text, 5, "the late answer")
    return message_id


def test_a_checker_that_times_out_counts_as_inconclusive(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Its last timeout is logged before the discard it led to (it was logged after)."""
    message_id = discarded_by_timeouts(engine, orders, fast, schema, caplog, "UNKNOWN", 2)
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "DISCARDED", 2)
    assert ops(engine, schema, message_id) == [
        ("DISCARDED", "2 inconclusive check-backs, the last: checker timed out after 0.2 s")]
    said = [r.getMessage().split(": ", 1)[-1].split(";")[0] for r in caplog.records
            if r.getMessage().startswith(f"message {message_id} ")]
    assert said == ["checker timed out after 0.2 s"] * 2 + [
        f"message {message_id} (producer group {GROUP!r}) discarded after 2 inconclusive "
        "check-backs"], said


@pytest.mark.parametrize(("answer", "status"), [("COMMIT", "PENDING"),
                                                ("ROLLBACK", "ROLLED_BACK")])
def test_a_decisive_answer_after_the_timeout_is_recorded_while_the_message_is_undecided(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture, answer: str, status: str
) -> None:
    """A checker always a little slower than the timeout had every answer dropped, without
    a word: 15 checks later its messages were discarded, though each answer had been COMMIT.
    A late COMMIT or ROLLBACK now decides a message still undecided, as a producer's late
    answer does in RocketMQ; its timeout stays counted."""
    message_id = prepare(engine, orders)
    with caplog.at_level(logging.INFO, "outbox.sweeper"), \
            sweeping(fast, {GROUP: answering_late(answer)}, checker_timeout=0.2,
                     check_interval=30):
        wait_resolution(engine, schema, message_id, answer, timeout=10)
    assert tuple(row(engine, schema, message_id))[1:] == (
        (status, 1) if status == "PENDING" else (status, None))
    assert f"message {message_id} (producer group {GROUP!r}): checker timed out after 0.2 s; " \
        "counted as inconclusive" in caplog.text, caplog.text
    assert re.search(rf"message {message_id} \(producer group {GROUP!r}\): its checker "
                     rf"answered {answer} 0\.\d s after its timeout of 0\.2 s; recorded",
                     caplog.text), caplog.text
    if answer == "ROLLBACK":
        [(action, detail)] = ops(engine, schema, message_id)
        assert (action, detail) == ("ROLLED_BACK", "check-back 1: checker answered ROLLBACK "
                                    "after its timeout of 0.2 s")


def test_a_late_answer_after_the_sweeper_stopped_is_not_recorded(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A sweeper stopped in a process that goes on (``Sweeper.run()`` returned) writes
    nothing more; the message is checked again by the next."""
    message_id = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"):
        with sweeping(fast, {GROUP: answering_late("COMMIT", 1.5)}, checker_timeout=0.2,
                      check_interval=30):
            wait_until(lambda: row(engine, schema, message_id).check_count == 1, 10,
                       "the check to time out")
        wait_until(lambda: "its checker answered" in caplog.text, 5, "the late answer")
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "PENDING", 1)
    assert "its checker answered COMMIT" in caplog.text
    assert "; not recorded: the sweeper has stopped (it is checked again)" in caplog.text


def test_a_late_answer_is_ignored_once_the_message_is_discarded(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    message_id = discarded_by_timeouts(engine, orders, fast, schema, caplog, "COMMIT", 1)
    assert tuple(row(engine, schema, message_id)) == ("UNKNOWN", "DISCARDED", 1)
    assert "its checker answered COMMIT" in caplog.text
    assert "after its timeout of 0.2 s; ignored: the message was decided or discarded " \
        f"meanwhile (`outbox resume {message_id}` checks a discarded one again)" in caplog.text


def test_a_due_row_locked_by_a_long_transaction_is_polled_less_and_less_often(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application deciding in a long transaction holds its row: the sweeper, finding it
    due yet unclaimable, looked again every 50 ms (two transactions each) while it stayed
    locked. It now waits twice as long each time, up to the poll interval, and checks the
    row once it is free."""
    looks: list[float] = []
    next_check_in = store.next_check_in

    def counted(*args: Any) -> float | None:
        looks.append(time.monotonic())
        return next_check_in(*args)

    monkeypatch.setattr(store, "next_check_in", counted)
    message_id = prepare(engine, orders)
    time.sleep(0.3)  # past the transaction timeout: due
    with engine.connect() as holder:
        holder.execute(text(f"SELECT 1 FROM {schema}.pending WHERE message_id = :id "
                            "FOR UPDATE"), {"id": message_id})
        with sweeping(fast, {GROUP: lambda message, conn: "COMMIT"},
                      sweep_poll_interval=1.0):
            time.sleep(3)
            held = len(looks)
            holder.rollback()
            wait_resolution(engine, schema, message_id, "COMMIT", timeout=10)
    assert 3 <= held <= 15, looks


def test_a_check_cancelled_at_its_deadline_is_logged_and_counted_once(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A checker waiting in a query is cancelled at the deadline, which the sweeper logs and
    counts; the cancellation then ending the check is not a second failure of it."""
    def waits_in_a_query(message: Message, conn: Connection) -> str:
        conn.execute(text("SELECT pg_sleep(2)"))
        return "COMMIT"

    message_id = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
            sweeping(fast, {GROUP: waits_in_a_query}, check_max=2, checker_timeout=0.2):
        wait_status(engine, schema, message_id, "DISCARDED")
    counted = [r.getMessage() for r in caplog.records
               if r.getMessage().startswith(f"message {message_id} ")
               and "counted as inconclusive" in r.getMessage()]
    assert counted == [f"message {message_id} (producer group {GROUP!r}): checker timed out "
                       f"after 0.2 s; counted as inconclusive"] * 2


def test_a_slow_checker_does_not_starve_the_others(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    release = threading.Event()

    def stuck(message: Message, conn: Connection) -> str:
        release.wait(20)
        return "COMMIT"

    stuck_id = prepare(engine, Outbox(settings=fast, producer_group="stuck"))
    quick_ids = [prepare(engine, orders) for _ in range(6)]
    with sweeping(fast, {"stuck": stuck, GROUP: answering("COMMIT")}, sweep_concurrency=3,
                  checker_timeout=30):
        for message_id in quick_ids:
            wait_resolution(engine, schema, message_id, "COMMIT")
        assert row(engine, schema, stuck_id).resolution == "UNKNOWN"
        release.set()
        wait_resolution(engine, schema, stuck_id, "COMMIT")


def test_a_groups_backlog_does_not_hold_up_the_checks_of_the_other_groups(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """Claims took the due rows of every group oldest first: a backlog of one group's slow
    checks (a gateway answering in seconds) held back every other group's, all due later,
    until the whole backlog was checked. Each claim now takes the groups in turn."""
    def slow(message: Message, conn: Connection) -> str:
        time.sleep(0.5)
        return "COMMIT"

    backlog = [prepare(engine, Outbox(settings=fast, producer_group="slow")) for _ in range(12)]
    time.sleep(0.5)  # the backlog is due first
    quick_id = prepare(engine, orders)
    time.sleep(0.3)
    with sweeping(fast, {"slow": slow, GROUP: answering("COMMIT")}, sweep_concurrency=2):
        wait_resolution(engine, schema, quick_id, "COMMIT", timeout=20)
        left = sum(row(engine, schema, message_id).resolution == "UNKNOWN"
                   for message_id in backlog)
    assert left >= 8, f"{left} of the backlog's 12 checks were left when the group's turn came"


def test_checkers_stuck_past_their_timeout_do_not_starve_the_other_groups(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Python checker stuck for good (a network call without a timeout, to a host that
    drops its packets) keeps its thread. Each timed-out check stayed one of the
    ``sweep_concurrency`` slots, and its message was claimed again and stuck again: with
    every slot stuck, no message of any group was checked again, and nothing said why."""
    release = threading.Event()

    def hangs(message: Message, conn: Connection) -> str:
        release.wait(60)
        return "COMMIT"

    hung = Outbox(settings=fast, producer_group="hung")
    stuck_ids = [prepare(engine, hung) for _ in range(4)]
    try:
        with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
                sweeping(fast, {"hung": hangs, GROUP: answering("COMMIT")},
                         sweep_concurrency=2, checker_timeout=0.5, check_interval=0.5):
            time.sleep(4)  # every slot stuck, had the stuck ones kept theirs
            quick_ids = [prepare(engine, orders) for _ in range(3)]
            for message_id in quick_ids:
                wait_resolution(engine, schema, message_id, "COMMIT", timeout=10)
            assert any(r.getMessage().startswith("producer group 'hung': ")  # 1 or 2 of
                       and "checks still run past their timeout" in r.getMessage()  # them
                       for r in caplog.records), caplog.text
            release.set()
            for message_id in stuck_ids:
                wait_resolution(engine, schema, message_id, "COMMIT", timeout=20)
    finally:
        release.set()


# --- decisions and claims ------------------------------------------------------------------

def test_a_decision_held_open_during_a_timed_out_check_stops_no_other_check(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
) -> None:
    """The sweeper counts a timed-out check in its main loop. An application that decided
    that message in a transaction still open held the row's lock, and the main loop waited
    for it: no message of any group was claimed until the application committed."""
    in_check, release = threading.Event(), threading.Event()
    first = prepare(engine, orders)

    def slow_then_quick(message: Message, conn: Connection) -> str:
        if message.id == first:
            in_check.set()
            release.wait(20)
        return "COMMIT"

    with sweeping(fast, {GROUP: slow_then_quick}, checker_timeout=1), \
            Session(engine) as app:
        assert in_check.wait(30)
        app.begin()
        orders.commit(app, first)  # the row is locked until the application commits
        time.sleep(2 * fast.checker_timeout)  # past the check's deadline
        later = prepare(engine, orders)
        wait_resolution(engine, schema, later, "COMMIT", timeout=10)
        app.commit()
        release.set()
    assert row(engine, schema, first).resolution == "COMMIT"



@pytest.mark.parametrize(("decision", "late_answer", "resolved"), [
    ("commit", "ROLLBACK", "COMMIT"),
    ("commit", "UNKNOWN", "COMMIT"),
    ("rollback", "COMMIT", "ROLLBACK"),
])
def test_a_decision_arriving_during_a_check_wins_over_its_answer(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    decision: str, late_answer: str, resolved: str,
) -> None:
    in_check, release = threading.Event(), threading.Event()

    def hesitant(message: Message, conn: Connection) -> str:
        in_check.set()
        release.wait(20)
        return late_answer

    message_id = prepare(engine, orders)
    with sweeping(fast, {GROUP: hesitant}, checker_timeout=30):
        assert in_check.wait(30)
        getattr(orders, decision)(engine, message_id)
        release.set()
    # Stopping the sweeper waited for the check: its answer has been offered and refused.
    decided = row(engine, schema, message_id)
    assert decided.resolution == resolved
    if resolved == "COMMIT":
        assert decided.check_count == 0, "the refused answer was not counted"
    else:
        assert ops(engine, schema, message_id) == [
            ("ROLLED_BACK", "decided ROLLBACK by the application")]


def test_two_sweepers_never_check_one_message_at_the_same_time(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """Also with one worker id (both sweepers' here): a claim is the message's own (its
    token), not the sweeper's, so a sweeper need not refuse a twin as a relay does; the id
    only names its op records' actor."""
    checks: dict[int, list[tuple[float, float]]] = defaultdict(list)
    by_sweeper: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def recording(name: str) -> Checker:
        def checker(message: Message, conn: Connection) -> str:
            started = time.monotonic()
            time.sleep(0.02)
            with lock:
                checks[message.id].append((started, time.monotonic()))
                by_sweeper[name] += 1
            return "UNKNOWN"
        return checker

    ids = [prepare(engine, orders) for _ in range(30)]
    with sweeping(fast, {GROUP: recording("a")}, check_max=3, sweep_concurrency=2) as a, \
            sweeping(fast, {GROUP: recording("b")}, check_max=3, sweep_concurrency=2) as b:
        assert a.settings.worker_id == b.settings.worker_id
        for message_id in ids:
            wait_status(engine, schema, message_id, "DISCARDED")

    assert by_sweeper["a"] > 0 and by_sweeper["b"] > 0
    for message_id in ids:
        intervals = sorted(checks[message_id])
        assert len(intervals) == 3, f"message {message_id} was checked {len(intervals)} times"
        for (_, ended), (started, _) in itertools.pairwise(intervals):
            assert ended <= started, f"message {message_id} was checked twice at once"


def test_a_crashed_sweepers_claim_expires_and_the_row_is_checked_again(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    message_id = prepare(engine, orders)
    wait_until(lambda: _due(engine, schema), 10, "the message to be due")
    with engine.begin() as conn:  # a sweeper claims the row, then dies before answering
        claims = store.claim_checks(conn, schema, [GROUP], 10, claim_seconds=0.5)
    assert [c.message.id for c in claims] == [message_id]

    with sweeping(fast, {GROUP: answering("COMMIT")}):
        wait_resolution(engine, schema, message_id, "COMMIT")
    assert row(engine, schema, message_id).check_count == 1


def _due(engine: Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            f"SELECT count(*) FROM {schema}.pending WHERE next_check_at <= now()")).scalar())


def test_a_group_without_a_checker_is_reported_once_and_never_counted(
    engine: Engine, fast: Settings, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    orphan = prepare(engine, Outbox(settings=fast, producer_group="nobody"))
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
            sweeping(fast, {GROUP: answering("COMMIT")}) as sweeper:
        wait_until(lambda: sweeper.counts.unchecked == {"nobody": 1}, 30, "the report")
        time.sleep(10 * fast.check_interval)  # several sweep rounds

    assert tuple(row(engine, schema, orphan)) == ("UNKNOWN", "PENDING", 0)
    warnings = [r.getMessage() for r in caplog.records if "'nobody'" in r.getMessage()]
    assert len(warnings) == 1
    assert "no checker for it: register one with @outbox.checker('nobody')" in warnings[0]


def test_the_sweeper_carries_on_after_losing_its_database_connections(
    engine: Engine, orders: Outbox, fast: Settings, schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), \
            sweeping(fast, {GROUP: answering("COMMIT")}):
        wait_resolution(engine, schema, before, "COMMIT")
        with engine.connect() as conn:
            killed = conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = :name"), {"name": f"outbox-sweeper:{fast.worker_id}"}
            ).scalar()
        after = prepare(engine, orders)
        wait_resolution(engine, schema, after, "COMMIT")
    assert killed
    assert "cannot reach PostgreSQL" in caplog.text


def test_status_counts_messages_no_sweeper_checks(
    engine: Engine, fast: Settings, schema: str
) -> None:
    prepare(engine, Outbox(settings=fast, producer_group="nobody"))

    def check_backs(checker_timeout: str) -> list[dict[str, Any]]:
        """``outbox status``: overdue means past due by more than a sweeper takes to claim it
        (the checker's timeout + a claim margin + a poll)."""
        env = outbox_env(fast, OUTBOX_CHECKER_TIMEOUT=checker_timeout,
                         OUTBOX_SWEEP_POLL_INTERVAL="0.1")
        status = run_outbox(None, "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        return list(json.loads(status.stdout)["check_backs"])

    # A sweeper may still claim it: a minute's timeout cannot have run out, however slow the
    # command starts (with 0.1 s, CI once took the 2.2 s to start and saw it overdue already).
    assert check_backs("60") == [{"producer_group": "nobody", "unresolved": 1, "overdue": 0}]
    # No sweeper runs: once past the time a sweeper takes to claim it, the message is overdue.
    wait_until(lambda: check_backs("0.1")[0]["overdue"] == 1, 30, "the message to be overdue")


# --- operator: discarded, resume, late decisions -------------------------------------------

def test_discarded_messages_are_listed(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    message_id = prepare(engine, orders, "payments", key="customer-7")
    later = prepare(engine, orders, "payments", key="customer-8")
    with caplog.at_level(logging.WARNING, logger="outbox.sweeper"), \
            sweeping(fast, {GROUP: answering(None)}, check_max=1):
        wait_status(engine, schema, message_id, "DISCARDED")
        wait_status(engine, schema, later, "DISCARDED")
    assert (f"message {message_id} (producer group 'orders') discarded after 1 inconclusive "
            f"check-back; `outbox resume {message_id}` checks it again") in caplog.messages

    listed = run_outbox(fast, "discarded", "--limit", "1")
    assert listed.returncode == 0, listed.stderr
    line = listed.stdout.strip()
    assert line.startswith(f"{message_id}\tgroup=orders\ttopic=payments\tkey=customer-7\t")
    assert line.endswith("\t1 inconclusive check-back: checker answered UNKNOWN"), line
    # the summary said "1 discarded" of the two
    assert listed.stderr.startswith("the oldest 1 of more (--limit) discarded"), listed.stderr
    assert run_outbox(fast, "discarded").stderr.startswith("2 discarded; ")


def test_resume_rearms_the_check_backs_of_a_discarded_message(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    message_id = prepare(engine, orders)
    answers = iter(["UNKNOWN", "COMMIT"])

    def first_unsure_then_sure(message: Message, conn: Connection) -> str:
        return next(answers)

    with sweeping(fast, {GROUP: first_unsure_then_sure}, check_max=1):
        wait_status(engine, schema, message_id, "DISCARDED")
        resumed = run_outbox(fast, "resume", str(message_id))
        assert resumed.stdout.strip() == f"resumed message {message_id} (was DISCARDED)"
        wait_resolution(engine, schema, message_id, "COMMIT")
    assert tuple(row(engine, schema, message_id)) == ("COMMIT", "PENDING", 1)


def test_a_late_commit_delivers_a_discarded_message(
    engine: Engine, orders: Outbox, fast: Settings, topic: str, schema: str, relay: Relay
) -> None:
    message_id = prepare(engine, orders, topic)
    with sweeping(fast, {GROUP: answering("UNKNOWN")}, check_max=1):
        wait_status(engine, schema, message_id, "DISCARDED")
    orders.commit(engine, message_id)
    wait_delivered(engine, schema, 1)
    assert [action for action, _ in ops(engine, schema, message_id)] == [
        "DISCARDED", "RESUMED", "DELIVERED"]


# --- the application dies between prepare and decision ------------------------------------

APPLICATION = """
import sys, time
from sqlalchemy import create_engine, text
from outbox import Outbox
from outbox.settings import load_settings

settings = load_settings()
engine = create_engine(settings.sqlalchemy_url)
outbox = Outbox(settings=settings, producer_group="orders")
commit_business = sys.argv[1] == "commit"

def place_order(message):
    with engine.connect() as conn:
        conn.execute(text(f"INSERT INTO {settings.schema_name}.orders (message_id) VALUES (:id)"),
                     {"id": message.id})
        if commit_business:
            conn.commit()
        print(message.id, flush=True)
        time.sleep(600)  # hangs here: the payment service never answers

outbox.send_in_transaction(engine, "orders", {"order": 1}, place_order)
"""


@pytest.mark.parametrize(("business", "resolved"), [("commit", "COMMIT"),
                                                    ("abandon", "ROLLBACK")])
def test_application_killed_between_prepare_and_decision_is_resolved_by_the_check_back(
    engine: Engine, fast: Settings, schema: str, business: str, resolved: str
) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.orders (message_id bigint PRIMARY KEY)"))
    application = subprocess.Popen(
        [sys.executable, "-c", APPLICATION, business],
        env=outbox_env(fast, OUTBOX_TRANSACTION_TIMEOUT=str(fast.transaction_timeout)),
        stdout=subprocess.PIPE, text=True)
    try:
        assert application.stdout is not None
        message_id = int(application.stdout.readline())
    finally:
        application.kill()  # SIGKILL between the local transaction and the decision
        application.wait(30)
    assert row(engine, schema, message_id).resolution == "UNKNOWN"

    def order_exists(message: Message, conn: Connection) -> str:
        placed = conn.execute(text(f"SELECT 1 FROM {schema}.orders WHERE message_id = :id"),
                              {"id": message.id}).scalar()
        return "COMMIT" if placed else "ROLLBACK"

    with sweeping(fast, {GROUP: order_exists}):
        wait_resolution(engine, schema, message_id, resolved)


# --- SQL checkers --------------------------------------------------------------------------

def test_a_sql_checker_resolves_from_the_business_tables(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str
) -> None:
    sql = (f"SELECT CASE state WHEN 'paid' THEN 'COMMIT' WHEN 'failed' THEN 'ROLLBACK' END "
           f"FROM {payments} WHERE order_id = CAST(CAST(:payload AS jsonb) ->> 'order' AS int)")
    paid, failed, pending = (prepare(engine, orders, payload={"order": n}) for n in (1, 2, 3))
    with sweeping(fast, sql_checkers={GROUP: sql}, check_max=2):
        wait_status(engine, schema, pending, "DISCARDED")
        wait_resolution(engine, schema, paid, "COMMIT")
        wait_status(engine, schema, failed, "ROLLED_BACK")


def test_a_sweeper_with_several_sql_checkers_starts_and_checks_each_group(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str
) -> None:
    """Checking the SQL checkers at start left the connection in a transaction after the
    first (its DISCARD ALL began one): the second group's check raised InvalidRequestError,
    and a sweeper with two SQL checkers never started."""
    refunds = Outbox(settings=fast, producer_group="refunds")
    paid = (f"SELECT CASE state WHEN 'paid' THEN 'COMMIT' END FROM {payments} "
            "WHERE order_id = CAST(:payload AS int)")
    ordered, refunded = prepare(engine, orders, payload=1), prepare(engine, refunds, payload=2)
    with sweeping(fast, sql_checkers={GROUP: paid, "refunds": "SELECT 'ROLLBACK'",
                                      "audits": "SELECT NULL"}):
        wait_resolution(engine, schema, ordered, "COMMIT", timeout=15)
        wait_status(engine, schema, refunded, "ROLLED_BACK", timeout=15)


def test_a_wrong_answer_or_a_long_error_is_logged_and_recorded_bounded_without_content(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SQL checker answering its payload had the payload logged and written in the op
    record (the README: logs never carry payloads), and ten million characters of answer
    or error made a log line and an op record of ten million characters."""
    card = "4111-1111-1111-1111"
    leaked = prepare(engine, orders, payload={"card": card})
    with sweeping(fast, sql_checkers={GROUP: "SELECT :payload"}, check_max=1):
        wait_status(engine, schema, leaked, "DISCARDED", timeout=15)
    long = prepare(engine, orders)

    def raises_long(message: Message, conn: Connection) -> str:
        raise ValueError("x" * 1_000_000)

    with sweeping(fast, {GROUP: raises_long}, check_max=1):
        wait_status(engine, schema, long, "DISCARDED", timeout=15)
    [(_, leaked_detail)] = ops(engine, schema, leaked)
    [(_, long_detail)] = ops(engine, schema, long)
    assert card not in caplog.text and card not in leaked_detail
    assert "answered a value of type str (length 30)" in leaked_detail, leaked_detail
    assert len(long_detail) < 600 and long_detail.endswith("(1000027 characters)"), \
        long_detail[:100]
    assert max(len(r.getMessage()) for r in caplog.records) < 1000


def test_sql_checkers_can_be_declared_in_the_environment(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str
) -> None:
    message_id = prepare(engine, orders, payload={"order": 1})
    declared = ('{"orders": "SELECT CASE state WHEN $$paid$$ THEN $$COMMIT$$ END '
                f'FROM {payments} '
                'WHERE order_id = CAST(CAST(:payload AS jsonb) ->> $$order$$ AS int)"}')
    sweeper = start_outbox(fast, "sweep", "--check-interval", "0.1",
                           OUTBOX_SQL_CHECKERS=declared)
    try:
        wait_resolution(engine, schema, message_id, "COMMIT")
    finally:
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    assert f"message {message_id} (producer group 'orders') resolved COMMIT" in output


def test_a_check_the_server_could_not_run_is_not_counted_against_the_message(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """The check's connection ended by the server (a restart, a failover, an administrator)
    said nothing of the message, yet it counted as inconclusive: at check_max 1 the message
    was DISCARDED, and the later messages of its key went out ahead of it."""
    message_id = prepare(engine, orders)
    first = threading.Event()

    def checker(message: Message, conn: Connection) -> str:
        if not first.is_set():
            first.set()
            conn.execute(text("SELECT pg_sleep(1.5)"))
        return "COMMIT"

    with sweeping(fast, {GROUP: checker}, check_max=1):
        wait_until(first.is_set, 30, "the first check")
        with engine.connect() as conn:
            wait_until(lambda: conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query = 'SELECT pg_sleep(1.5)'")).scalar_one() == 1, 10,
                "the check's backend to end")
        wait_resolution(engine, schema, message_id, "COMMIT")
    assert row(engine, schema, message_id).status == "PENDING"


def test_a_sql_checker_runs_read_only(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A write hidden in a function its role may call (its plan at start shows none) is
    refused by the check's read-only transaction, and said to be PostgreSQL's refusal (it
    was `checker raised InternalError`, as if the checker had failed)."""
    with engine.begin() as conn:
        conn.execute(text(f"GRANT DELETE ON {payments} TO {schema}_checker"))
        conn.execute(text(
            f"CREATE FUNCTION {schema}_shop.forget() RETURNS boolean LANGUAGE sql "
            f"AS 'DELETE FROM {payments} RETURNING true'"))
        conn.execute(text(f"GRANT EXECUTE ON FUNCTION {schema}_shop.forget() "
                          f"TO {schema}_checker"))
    message_id = prepare(engine, orders)
    with caplog.at_level(logging.WARNING, "outbox.sweeper"), sweeping(
            fast, sql_checkers={GROUP: f"SELECT 'COMMIT' WHERE {schema}_shop.forget()"},
            check_max=1):
        wait_status(engine, schema, message_id, "DISCARDED")
    assert "PostgreSQL refused: cannot execute DELETE in a read-only transaction" in \
        ops(engine, schema, message_id)[0][1]
    assert "PostgreSQL refused: cannot execute DELETE in a read-only" in caplog.text
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {payments}")).scalar() == 3


def test_a_sql_checker_is_cut_off_at_the_checker_timeout(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str]
) -> None:
    message_id = prepare(engine, orders)
    with sweeping(fast, sql_checkers={GROUP: "SELECT 'COMMIT' FROM pg_sleep(30)"},
                  check_max=1, checker_timeout=0.3):
        wait_status(engine, schema, message_id, "DISCARDED")
    assert ops(engine, schema, message_id)[0][1].endswith("checker timed out after 0.3 s")


def test_a_check_an_operator_cancels_is_not_counted_as_timed_out(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, roles: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``pg_cancel_backend`` (an operator, a watchdog) ends a check's statement as its
    timeout would, with the same SQLSTATE: each cancel was logged as "timed out after 2 s"
    and counted, and a message whose checker answers COMMIT was discarded."""
    caplog.set_level(logging.INFO, logger="outbox.sweeper")
    message_id = prepare(engine, orders)
    cancelled = 0
    with sweeping(fast, sql_checkers={GROUP: "SELECT 'COMMIT' FROM pg_sleep(0.5)"},
                  check_max=2):
        with engine.connect() as operator:
            deadline = time.monotonic() + 30
            while cancelled < 3 and time.monotonic() < deadline:
                cancelled += int(operator.execute(text(
                    "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM pg_stat_activity "
                    "WHERE wait_event = 'PgSleep' AND application_name LIKE 'outbox-sweeper:%'")
                ).scalar_one())
                operator.commit()
                time.sleep(0.05)
        assert row(engine, schema, message_id).status != "DISCARDED", ops(
            engine, schema, message_id)
        assert cancelled >= 3
        wait_until(lambda: row(engine, schema, message_id).resolution == "COMMIT", 30,
                   "the checker's answer")
    assert "timed out" not in caplog.text, caplog.text
    assert "check-back failed, retried when its claim expires" in caplog.text


def test_a_sql_checker_waiting_for_a_locked_table_is_cut_off_as_a_timeout(
    engine: Engine, orders: Outbox, fast: Settings, schema: str, payments: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL reads the tables a statement names as it prepares it. A checker of a table
    locked by a migration waited in its prepare: cut off at the checker timeout, the check
    was recorded as "PostgreSQL refused", as if the checker could not run; at start, the
    sweeper refused to start."""
    caplog.set_level(logging.INFO, logger="outbox.sweeper")
    with engine.connect() as locker, locker.begin():
        locker.execute(text(f"LOCK TABLE {payments} IN ACCESS EXCLUSIVE MODE"))
        with sweeping(fast, sql_checkers={GROUP: f"SELECT 'COMMIT' FROM {payments}"},
                      check_max=1, checker_timeout=0.3):
            wait_until(lambda: "started" in caplog.text, 10, "the sweeper to start")
            message_id = prepare(engine, orders)
            wait_status(engine, schema, message_id, "DISCARDED")
    assert ops(engine, schema, message_id)[0][1].endswith("checker timed out after 0.3 s")
    assert "could not prepare the SQL checker" in caplog.text, caplog.text


def test_a_python_checker_stuck_between_statements_holds_no_transaction_past_its_claim(
    engine: Engine, orders: Outbox, fast: Settings, schema: str
) -> None:
    """A Python checker's thread cannot be stopped. Stuck outside any statement (a call that
    never returns), it kept its check's transaction open, and its snapshot held back vacuum,
    for as long as it was stuck: only a statement was cut off at the checker timeout."""
    release = threading.Event()
    checking = threading.Event()

    def stuck(message: Message, conn: Connection) -> str:
        conn.execute(text("SELECT 1"))
        checking.set()
        release.wait(30)
        return "COMMIT"

    prepare(engine, orders)
    try:
        with sweeping(fast, {GROUP: stuck}, checker_timeout=0.5):
            wait_until(checking.is_set, 10, "the check to start")
            wait_until(lambda: checks_open(engine, fast) == 1, 10, "the check's transaction, idle")
            wait_until(lambda: checks_open(engine, fast) == 0, 10,
                       "the session to end past the claim")
    finally:
        release.set()


# --- the command --------------------------------------------------------------------------

def test_sweep_command_uses_the_checkers_of_the_app(
    engine: Engine, fast: Settings, schema: str
) -> None:
    message_id = prepare(engine, Outbox(settings=fast, producer_group="cli-orders"))
    sweeper = start_outbox(fast, "sweep", "--app", "tests.checker_app:outbox",
                           "--check-interval", "0.1")
    try:
        wait_resolution(engine, schema, message_id, "COMMIT")
    finally:
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    assert "checkers for cli-orders" in output


@contextmanager
def stuck_sweeper(engine: Engine, fast: Settings, schema: str, *args: str
                  ) -> Iterator[tuple[OutboxProcess, int]]:
    """`outbox sweep` whose Python checker never answers, once its first check timed out;
    killed afterwards if it is still running."""
    message_id = prepare(engine, Outbox(settings=fast, producer_group="stuck-orders"))
    sweeper = start_outbox(fast, "sweep", "--app", "tests.checker_app:stuck",
                           "--check-interval", "0.1", "--checker-timeout", "0.5", *args)
    try:
        wait_until(lambda: row(engine, schema, message_id).check_count >= 1, 30,
                   "the check to time out")
        yield sweeper, message_id
    finally:
        if sweeper.poll() is None:
            sweeper.kill()
            sweeper.communicate()


def test_sweep_command_stops_on_sigterm_though_a_checker_never_answers(
    engine: Engine, fast: Settings, schema: str
) -> None:
    """A Python checker cannot be stopped: its thread outlived the sweeper's loop, and the
    interpreter waited for it at exit, so SIGTERM never ended the process."""
    with stuck_sweeper(engine, fast, schema) as (sweeper, message_id):
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    assert f"checks of messages {message_id} are still running past their timeout" in output


def test_sigterm_does_not_wait_for_checks_already_counted_as_timed_out(
    engine: Engine, fast: Settings, schema: str
) -> None:
    """A check past its timeout is counted, its message here discarded: the sweeper waited
    for it all the same, a whole checker timeout, then said its message would be checked
    again."""
    with stuck_sweeper(engine, fast, schema, "--checker-timeout", "8", "--check-max", "1"
                       ) as (sweeper, message_id):
        wait_status(engine, schema, message_id, "DISCARDED")
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=5)  # not the 8 s of another timeout
    assert sweeper.returncode == 0, output
    assert (f"checks of messages {message_id} are still running past their timeout (a "
            "Python checker cannot be stopped); their timeouts are counted") in output, output
    assert "checked again" not in output, output


def test_sweep_command_exits_on_a_setup_error_though_a_checker_never_answers(
    engine: Engine, fast: Settings, schema: str
) -> None:
    """The same stuck thread, when the sweeper stopped on an error (a privilege revoked, a
    table dropped): the error was printed, then the interpreter waited for the thread at
    exit, for ever, and no supervisor could restart the process."""
    with stuck_sweeper(engine, fast, schema) as (sweeper, _):
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {schema}.pending CASCADE"))
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 2, output
    assert "outbox: error: a table is missing" in output, output


@pytest.mark.parametrize(("checker", "why"), [
    (("--app", "tests.checker_app:stuck"), "a Python checker cannot be stopped"),
    ((), "a SQL checker's statement ends at its checker_timeout"),
], ids=["python", "sql"])
def test_a_second_sigterm_abandons_the_checks_the_sweeper_waits_for(
    engine: Engine, fast: Settings, schema: str, roles: list[str], checker: tuple[str, ...],
    why: str
) -> None:
    """On the first SIGTERM the sweeper lets running checks land their answers, for up to
    the checker timeout; a second one abandons them, as it does the relay's work. It was not
    heard: the process waited out the whole timeout (here a minute) all the same. (Abandoned
    SQL checks were said to be a Python checker's, which cannot be stopped.)"""
    message_id = prepare(engine, Outbox(settings=fast, producer_group="stuck-orders"))
    sweeper = start_outbox(fast, "sweep", *checker, "--check-interval", "0.1",
                           "--checker-timeout", "60", OUTBOX_WORKER_ID=fast.worker_id,
                           OUTBOX_SQL_CHECKERS='{"stuck-orders": '
                           '"SELECT \'UNKNOWN\' FROM pg_sleep(60)"}' if not checker else "{}")
    try:
        wait_until(lambda: checks_open(engine, fast, "active" if not checker else "idle in "
                                       "transaction") == 1, 30, "the check to start")
        sweeper.send_signal(signal.SIGTERM)
        wait_until(lambda: "signal again to abandon it" in Path(sweeper.log).read_text(), 10,
                   "the first signal to be heard")
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=10)
    finally:
        if sweeper.poll() is None:
            sweeper.kill()
            sweeper.communicate()
    assert sweeper.returncode == 0, output
    assert f"checks of messages {message_id} were abandoned ({why})" in output, output
    assert row(engine, schema, message_id).check_count == 0  # not counted: checked again


@pytest.mark.parametrize(("args", "env", "error"), [
    (("--app", "no_such_service.outbox:outbox"), {},
     "--app no_such_service.outbox:outbox: cannot import 'no_such_service.outbox'"),
    (("--app", "tests.checker_app:missing"), {},
     "--app tests.checker_app:missing: tests.checker_app has no attribute 'missing'"),
    (("--app", "tests.checker_app:order_was_placed"), {},
     "tests.checker_app.order_was_placed is a function, not an outbox.Outbox"),
    ((), {}, "the sweeper has no checkers: pass --app module:outbox"),
    (("--app", ":outbox"), {}, "--app :outbox: give module:attribute"),
    (("--app", ".checker_app:outbox"), {}, "--app .checker_app:outbox: give module:attribute"),
    ((), {"OUTBOX_SQL_CHECKERS": "{not json"}, "invalid settings"),
])
def test_sweep_command_misconfiguration_is_one_line(
    fast: Settings, args: tuple[str, ...], env: dict[str, str], error: str
) -> None:
    result = run_outbox(None, "sweep", *args, env=outbox_env(fast, **env))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("outbox: error: "), result.stderr
    assert error in lines[0]


def advisory_locks(engine: Engine, key: int) -> int:
    """How many sessions hold the advisory lock ``key``."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = :key"),
            {"key": key}).scalar_one())
