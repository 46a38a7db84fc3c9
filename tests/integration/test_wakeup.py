"""Waking the relay: publishers notify only while a relay sleeps on their shard, and a relay
falls asleep only once every publisher that did not notify has committed (relay/wakeup.py)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.relay import relay as relay_module
from outbox.relay.relay import Relay
from outbox.relay.wakeup import Wakeup
from outbox.schema import SHARDS
from outbox.settings import Settings
from tests.conftest import publish_orders, running, wait_delivered, wait_until

ALL = frozenset(range(SHARDS))


@pytest.fixture
def wakeup(settings: Settings, schema: str) -> Iterator[Wakeup]:
    made = Wakeup(settings.database_url, schema)
    try:
        yield made
    finally:
        made.close()


def notified(wakeup: Wakeup) -> set[str]:
    return wakeup.wait(0.5, threading.Event(), threading.Event())


def wake_locks(engine: Engine) -> int:
    """Wake locks held exclusively (by sleeping relays), in any schema."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = :class AND mode = 'ExclusiveLock'"),
            {"class": store.WAKE_LOCK_CLASS}).scalar_one())


def test_publishers_notify_only_while_a_relay_sleeps_on_their_shard(
    engine: Engine, outbox: Outbox, topic: str, wakeup: Wakeup
) -> None:
    publish_orders(engine, outbox, topic, [("k", 1)])
    assert notified(wakeup) == set(), "nobody sleeps: a commit costs no NOTIFY"

    assert wakeup.fall_asleep(ALL) == set()
    assert wake_locks(engine) == SHARDS
    publish_orders(engine, outbox, topic, [("k", 2)])
    assert notified(wakeup) == {""}

    wakeup.rise()
    assert wake_locks(engine) == 0
    publish_orders(engine, outbox, topic, [("k", 3)])
    assert notified(wakeup) == set(), "awake again: publishers stay quiet"

    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, {"n": 4}, key="k", deliver_after=timedelta(seconds=30))
    assert notified(wakeup) == {store.DELAYED_NOTE}, "a delayed row always says when it is due"


def test_falling_asleep_waits_for_the_publishers_that_did_not_notify(
    engine: Engine, outbox: Outbox, topic: str, wakeup: Wakeup
) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, {"n": 1}, key="k")  # awake relay: no NOTIFY queued
        started = time.monotonic()
        assert wakeup.fall_asleep(ALL) is None, "its row is not visible yet"
        assert time.monotonic() - started < 1, "gave up after the lock timeout"
        assert wake_locks(engine) == 0, "gave up holding none"
    assert wakeup.fall_asleep(ALL) == set(), "committed: the next fetch sees the row"
    assert wake_locks(engine) == SHARDS


@pytest.mark.parametrize(("rise_after", "batch_size"), [
    (0.0, 2000),  # rises at every batch: publishers stop notifying, it must fetch again
    (60.0, 5),  # never rises: it waits after a batch that saw every row, not after a full one
], ids=["rising", "asleep"])
def test_no_wake_up_is_lost_while_publishers_and_the_relay_race(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    monkeypatch: pytest.MonkeyPatch, rise_after: float, batch_size: int
) -> None:
    """Four threads publish in bursts and pauses, some transactions staying open after
    publishing past the relay's wait for their wake lock. The relay falls asleep at every
    empty fetch, and would otherwise poll every 30 s. Every message is delivered within
    seconds of the last commit."""
    monkeypatch.setattr(relay_module, "BUSY_BEFORE_RISING", rise_after)
    slow_poll = settings.model_copy(update={"relay_poll_interval": 30.0,
                                            "relay_batch_size": batch_size})
    stop_at, published = time.monotonic() + 5, [0] * 4

    def publisher(slot: int) -> None:
        chance = random.Random(slot)
        with Session(engine) as session:
            while time.monotonic() < stop_at:
                burst_end = time.monotonic() + chance.uniform(0.1, 0.4)
                while time.monotonic() < burst_end:
                    with session.begin():
                        outbox.publish(session, topic, {"n": published[slot]}, key=f"k{slot}")
                        time.sleep(chance.choice((0, 0, 0, 0.002, 0.02)))
                    published[slot] += 1
                time.sleep(chance.uniform(0, 0.1))

    with running(Relay(slow_poll), "relay") as daemon:
        wait_until(lambda: bool(daemon.owned_shards), 10, "relay to own its shards")
        threads = [threading.Thread(target=publisher, args=(s,)) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_delivered(engine, schema, sum(published), timeout=10)
    assert sum(published) > 500


def test_a_sleeping_relay_fetches_again_after_a_full_batch(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """One commit of 12 messages sends one notification; batches of 5 take three fetches.
    A sleeping relay waits for notifications only after a fetch that saw every row."""
    monkeypatch.setattr(relay_module, "BUSY_BEFORE_RISING", 60.0)
    small_batches = settings.model_copy(update={"relay_poll_interval": 30.0,
                                                "relay_batch_size": 5})
    with running(Relay(small_batches), "relay"):
        wait_until(lambda: wake_locks(engine) == SHARDS, 10, "the relay to fall asleep")
        publish_orders(engine, outbox, topic, [(f"k{n % 3}", n) for n in range(12)])
        wait_delivered(engine, schema, 12, timeout=10)


def test_a_relay_woken_for_nothing_a_thousand_times_keeps_waking(
    engine: Engine, schema: str, wakeup: Wakeup
) -> None:
    """Each wake-up that finds nothing doubles the pause before the next, up to a cap: the
    doubling itself was not capped, and the 1,027th (a service that publishes only delayed
    messages, each notifying long before it is due) raised OverflowError and ended the relay."""
    for _ in range(1_100):
        wakeup.found_work(False)  # what the relay says after each empty fetch
    with engine.begin() as conn:
        conn.execute(text(f"NOTIFY {store.notify_channel(schema)}, 'flood'"))
    assert notified(wakeup) == {"flood"}
