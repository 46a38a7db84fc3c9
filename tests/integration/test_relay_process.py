"""The relay as a process: killed with -9 mid-batch, stopped with SIGTERM (docs/guarantees.md)."""

from __future__ import annotations

import signal
from collections import Counter

from sqlalchemy import Engine, text

from outbox import Outbox
from outbox.dev.topics import read_topic
from outbox.settings import Settings
from tests.conftest import both_transports, count_status, publish_orders, wait_delivered, wait_until
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
        wait_until(lambda: count_status(engine, schema, "DELIVERED") > 0, 60, "first delivery")
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


def test_sigterm_stops_the_relay_cleanly_and_hands_back_its_shards(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    relay = start_outbox(settings, "relay")
    try:
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1)
        relay.send_signal(signal.SIGTERM)
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
