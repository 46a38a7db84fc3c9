"""What `outbox relay` and `outbox sweeper` set up in their own process."""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from outbox.relay import daemon
from outbox.relay.daemon import Lifecycle, run_until_signalled


class Recording:
    """A daemon that notes how many objects the garbage collector leaves alone as it runs."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle("recording", logging.getLogger("test"))
        self.frozen = 0

    def run(self) -> None:
        self.frozen = gc.get_freeze_count()

    def stop(self, *, abandon: bool = False) -> None:
        self.lifecycle.stop(abandon=abandon)


@pytest.fixture
def restored() -> Iterator[None]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        gc.unfreeze()
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_daemon_runs_with_its_start_up_objects_frozen_out_of_the_collector(
    restored: None,
) -> None:
    """Full collections walking them again and again cost the relay a fifth of its
    throughput."""
    assert gc.get_freeze_count() == 0
    daemon = Recording()
    run_until_signalled(daemon)
    assert daemon.frozen > 1000


class SignalledTwice(Recording):
    """A daemon signalled once while it runs and once more after its last line."""

    def run(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        self.lifecycle.say_stopped("recording stopped after %d things", 3)
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_after_the_daemon_said_it_stopped_is_ignored(
    restored: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """A second SIGTERM after "stopped after delivering N" logged "abandoning the work in
    hand": there was none left."""
    daemon = SignalledTwice()
    with caplog.at_level(logging.INFO, logger="test"):
        run_until_signalled(daemon)
    assert [r.getMessage() for r in caplog.records] == [
        "SIGTERM: finishing the work in hand, then stopping (signal again to abandon it)",
        "recording stopped after 3 things"]
    assert daemon.lifecycle.stopping.is_set() and not daemon.lifecycle.abandon.is_set()


def test_the_backoff_starts_short_again_after_the_daemon_recovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each outage of a long-lived daemon begins with a short wait, not the longest one its
    earlier outages reached."""
    lifecycle = Lifecycle("backing off", logging.getLogger("test"))
    waits: list[float] = []
    monkeypatch.setattr(lifecycle, "pause", waits.append)
    outcomes = iter(["fail"] * 6 + ["recover"] + ["fail"] * 2 + ["done"])

    def one_pass() -> None:
        for outcome in outcomes:
            if outcome == "done":
                return
            if outcome == "recover":
                lifecycle.recovered()
                continue
            raise ConnectionError(outcome)

    lifecycle.serve(one_pass, (ConnectionError,), max_wait=5)
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 0.2, 0.4])


def test_an_outage_is_said_once_per_kind_of_cause_and_reminded(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that waits for Kafka's acks, then fails, then waits again alternates between
    two kinds of cause: each is said once, not at every pass; the outage is said again after
    REMIND_SECONDS, and a new outage starts afresh."""
    clock = [1000.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])
    lifecycle = Lifecycle("relay r", logging.getLogger("outbox.test"))
    with caplog.at_level(logging.WARNING, "outbox.test"):
        for _ in range(3):
            lifecycle.outage("Kafka has not acknowledged 3 messages for 5s")
            lifecycle.outage(TimeoutError("no ack"))
            clock[0] += 10
        assert [r.getMessage() for r in caplog.records] == [
            "relay r paused: Kafka has not acknowledged 3 messages for 5s; retrying with "
            "backoff",
            "relay r still paused after 0s: TimeoutError: no ack"]
        clock[0] += daemon.REMIND_SECONDS
        lifecycle.outage(TimeoutError("no ack"))
        assert caplog.records[-1].getMessage() == "relay r still paused after 330s: " \
            "TimeoutError: no ack"
        lifecycle.recovered()
        lifecycle.outage(TimeoutError("again"))
        assert caplog.records[-1].getMessage() == ("relay r paused: TimeoutError: again; "
                                                   "retrying with backoff")


def test_database_errors_of_another_sqlstate_are_another_cause(
    caplog: pytest.LogCaptureFixture
) -> None:
    """Every database error is an OperationalError: a relay whose sessions were ended, then
    refused for want of connection slots, said only the first, for the whole outage."""
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    full = psycopg.errors.TooManyConnections("sorry, too many clients already")
    lifecycle = Lifecycle("relay r", logging.getLogger("outbox.test"))
    with caplog.at_level(logging.WARNING, "outbox.test"):
        for orig in (lost, full, lost, full):
            lifecycle.outage(OperationalError("SELECT 1", {}, orig))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "too many clients" in said[1]


@pytest.mark.parametrize(("orig", "fault"), [
    (psycopg.errors.UniqueViolation("duplicate key"), True),
    (psycopg.errors.RaiseException("refused by a trigger"), True),
    (psycopg.errors.ProgramLimitExceeded("index row size 3040 exceeds maximum 2704"), True),
    (psycopg.OperationalError("server closed the connection unexpectedly"), False),
    (psycopg.errors.AdminShutdown("terminating connection"), False),
    (psycopg.errors.TooManyConnections("too many clients"), False),
    (psycopg.errors.ReadOnlySqlTransaction("read-only transaction"), False),
    (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), False),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value))
def test_an_error_of_the_statement_is_told_from_an_outage(orig: Exception, fault: bool) -> None:
    assert daemon.statement_fault(OperationalError("SELECT 1", {}, orig)) is fault
