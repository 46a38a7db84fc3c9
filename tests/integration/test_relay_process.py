"""The relay as a process: killed with -9 mid-batch, stopped with SIGTERM (docs/guarantees.md)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox import Outbox, store
from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from outbox.settings import Settings
from tests.conftest import (
    both_transports,
    count_status,
    publish_orders,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.kafka_proxy import KafkaProxy
from tests.processes import start_outbox

pytestmark = both_transports


def test_relay_killed_mid_batch_then_restarted_loses_nothing(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    total = 20_000
    ids: list[int] = []
    for start in range(0, total, 2000):
        ids += publish_orders(engine, outbox, topic,
                              [(f"k{i % 50}", i) for i in range(start, start + 2000)])
    relay = start_outbox(settings, "relay", OUTBOX_RELAY_BATCH_SIZE="500")
    try:
        wait_until(lambda: recorded(engine, schema) > 0, 60, "first delivery")
        relay.kill()
        relay.wait(10)
        delivered_before = count_status(engine, schema, "DELIVERED")
        assert 0 < delivered_before < total, "the kill should land mid-stream"
    finally:
        relay.kill()

    # A new relay takes the dead one's shards once their leases expire.
    restarted = start_outbox(settings, "relay")
    try:
        wait_delivered(engine, schema, total, timeout=120)
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(30)

    seen = Counter(r.message_id for r in read_topic(settings.kafka_bootstrap, topic))
    assert set(seen) == set(ids), "every committed message reached Kafka"
    duplicates = sum(n - 1 for n in seen.values())
    assert duplicates <= 500 * 5, "at most the in-flight batches are sent twice"
    with engine.connect() as conn:
        op_counts = conn.execute(text(
            f"SELECT count(*), count(DISTINCT message_id) FROM {schema}.op_record")).one()
    assert tuple(op_counts) == (total, total), "one op record per message"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_stops_the_relay_cleanly_and_hands_back_its_shards(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    signum: signal.Signals,
) -> None:
    """SIGHUP (the relay's terminal or ssh session gone) ended it at once, exit 129, without
    a line or a handover: the next owner waited for the leases and read the tails."""
    relay = start_outbox(settings, "relay")
    try:
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1)
        relay.send_signal(signum)
        output, _ = relay.communicate(timeout=30)
    finally:
        relay.kill()
    assert relay.returncode == 0, output
    assert "stopped after delivering 1 messages" in output
    with engine.connect() as conn:
        owned = conn.execute(text(
            f"SELECT count(*) FROM {schema}.relay_lease WHERE owner IS NOT NULL")).scalar_one()
        members = conn.execute(text(f"SELECT count(*) FROM {schema}.relay_member")).scalar_one()
    assert (owned, members) == (0, 0)


def test_a_relay_that_abandons_its_batch_hands_its_shards_over_once_its_sends_cannot_land(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    services: devservices.Services,
) -> None:
    """A second SIGTERM abandons a batch Kafka does not acknowledge (here answered
    NOT_ENOUGH_REPLICAS, which the producer retries): the relay kept its shards for the rest
    of its lease, and the next relay waited up to an hour (relay_lease_seconds 3600). Now
    the leases end when none of its sends can land any more (its delivery timeout, 6 s here)
    and the next relay reads the tails and delivers each message once."""
    proxy = KafkaProxy(services.kafka_port)
    proxy.refuse(topic)
    relay = start_outbox(settings, "relay", OUTBOX_KAFKA_BOOTSTRAP=proxy.bootstrap,
                         OUTBOX_RELAY_LEASE_SECONDS="3600",
                         OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS="6000")
    try:
        ids = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(9)])
        wait_until(lambda: proxy.refusals[topic] > 0, 30, "the relay to send")
        relay.send_signal(signal.SIGTERM)
        wait_until(lambda: "signal again to abandon" in Path(relay.log).read_text(), 10,
                   "the relay to start stopping")
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=20)
    finally:
        relay.kill()
        proxy.close()
    assert relay.returncode == 0, output
    with engine.connect() as conn:
        lasts = conn.execute(text(
            f"SELECT max(extract(epoch FROM expires_at - now())), bool_or(clean) "
            f"FROM {schema}.relay_lease WHERE owner IS NOT NULL")).one()
    assert lasts[0] is None or (float(lasts[0]) <= 6 and not lasts[1]), (lasts, output)
    with running_relay(settings.model_copy(update={"relay_lease_seconds": 3600})):
        wait_delivered(engine, schema, len(ids), timeout=30)
    seen = Counter(r.message_id for r in read_topic(settings.kafka_bootstrap, topic))
    assert seen == Counter(ids), "each message once"


def holds_its_worker_id(engine: Engine) -> bool:
    """A relay process got as far as claiming its worker id (its signal handlers are set)."""
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :class"),
            {"class": store.WORKER_LOCK_CLASS}).scalar_one())


def test_a_relay_stopped_while_it_waits_for_kafka_at_start_exits_0_at_once(
    engine: Engine, settings: Settings
) -> None:
    """Stopped while no broker answered yet, the relay went on waiting out its connect
    timeout (15 s by default, longer than Docker's grace before SIGKILL) and then exited 2
    with a configuration error's line; then it exited 0, still after the whole wait."""
    relay = start_outbox(settings, "relay", OUTBOX_KAFKA_BOOTSTRAP="127.0.0.1:1",
                         OUTBOX_KAFKA_CONNECT_TIMEOUT_MS="300000")
    try:
        wait_until(lambda: holds_its_worker_id(engine), 30, "the relay to claim its worker id")
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    finally:
        relay.kill()
    assert relay.returncode == 0, output
    assert "stopped before Kafka answered" in output, output


def test_a_notify_flood_costs_the_relay_a_bounded_number_of_fetches(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    """Anyone may NOTIFY the relay's channel; five seconds of it must not spin the relay."""
    channel = store.notify_channel(schema)

    def scans_of_pending() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables "
                "WHERE schemaname = :schema AND relname = 'pending'"), {"schema": schema}
            ).scalar_one())

    before = scans_of_pending()
    relay = start_outbox(settings, "relay")
    try:
        time.sleep(3)  # up, shards owned, idle
        sent, end = 0, time.monotonic() + 5
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            while time.monotonic() < end:
                conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": channel})
                sent += 1
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1, timeout=15)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)

    def settled() -> bool:  # the relay's backends flush their counts as they exit
        seen = scans_of_pending()
        time.sleep(1)
        return scans_of_pending() == seen

    wait_until(settled, 15, "statistics to settle")
    fetches = scans_of_pending() - before
    assert sent > 2000, f"only {sent} notifications sent: the flood did not happen"
    # 3 free wake-ups, then pauses doubling to 100 ms: about 60 in 5 s, plus polls and
    # start-up; without the pauses the relay fetched once per notification drained.
    assert fetches < 200, f"{fetches} scans of pending for {sent} notifications"


def recorded(engine: Engine, schema: str) -> int:
    """Op records so far: cheaper to poll than a status count, so a kill lands mid-stream."""
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {schema}.op_record")).scalar_one())
