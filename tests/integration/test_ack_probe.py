"""bench/ack_probe.py, which the latency benchmarks' commit → Kafka ack rests on: a relay run
through it delivers as usual; every delivered message is handed to the Kafka client after
its publish, and acknowledged after that and before its op record."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from sqlalchemy import Engine, text

from outbox import Outbox
from outbox.settings import Settings
from tests.conftest import both_transports, publish_orders, wait_delivered
from tests.processes import OutboxProcess, outbox_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ack_probe import read_acks, read_sends

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = both_transports


def test_every_ack_is_timed_between_the_publish_and_the_op_record(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, tmp_path: Path
) -> None:
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 7}", i) for i in range(300)])
    probe = tmp_path / "relay.acks"
    relay = OutboxProcess([sys.executable, str(BENCH / "ack_probe.py"), str(probe), "relay"],
                          outbox_env(settings))
    try:
        wait_delivered(engine, schema, len(ids))
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    assert relay.returncode == 0, output

    partitions, offsets, times = read_acks(probe)
    acked = dict(zip(zip(partitions, offsets, strict=True), times, strict=True))
    handed = dict(zip(*read_sends(probe), strict=True))
    with engine.connect() as conn:
        rows = conn.execute(text(f"""
            SELECT o.message_id, o.kafka_partition, o.kafka_offset,
                   CAST(extract(epoch FROM m.created_at) AS float8) AS published,
                   CAST(extract(epoch FROM o.created_at) AS float8) AS recorded
            FROM {schema}.op_record AS o JOIN {schema}.message AS m ON m.id = o.message_id
            WHERE o.action = 'DELIVERED'""")).all()
    assert len(rows) == len(ids) == len(acked) == len(handed)
    for row in rows:
        ack = acked[row.kafka_partition, row.kafka_offset]
        assert row.published < handed[row.message_id] < ack <= row.recorded, row
