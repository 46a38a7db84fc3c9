"""Chaos: writers commit and roll back at random while relays are killed with -9 and
restarted, the broker's connections are cut and PostgreSQL restarts; then a checker proves
nothing committed is missing, nothing rolled back is present, and each key kept its order."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import text

from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from tests.conftest import wait_until
from tests.isolated import Isolated, isolated_services
from tests.processes import start_outbox

WRITERS = 3
RELAYS = 3
WRITE_SECONDS = 25


def test_chaos(tmp_path: Path) -> None:
    rng = random.Random(20261122)
    with isolated_services(partitions=6) as iso:
        settings = iso.settings
        relays = [start_relay(iso, n) for n in range(RELAYS)]
        writers = [
            subprocess.Popen([sys.executable, "-m", "tests.chaos_writer", "--url",
                              settings.database_url, "--schema", "outbox", "--topic", iso.topic,
                              "--seconds", str(WRITE_SECONDS), "--seed", str(n), "--out",
                              str(tmp_path / f"writer-{n}.jsonl")])
            for n in range(WRITERS)
        ]
        events: list[str] = []
        try:
            started = time.monotonic()

            def at(second: float) -> None:
                time.sleep(max(0.0, started + second - time.monotonic()))

            victims = rng.sample(range(RELAYS), RELAYS)  # each relay is killed once
            for second, action in [(4, "kill"), (8, "cut"), (15, "restart-postgres"),
                                   (19, "kill"), (22, "kill")]:
                at(second)
                if action == "kill":
                    victim = victims.pop()
                    relays[victim].kill()
                    relays[victim].wait()
                    time.sleep(rng.uniform(0.2, 1.5))
                    relays[victim] = start_relay(iso, victim)
                    events.append(f"{second}s kill -9 relay {victim}, restarted")
                elif action == "cut":
                    iso.proxy.cut()
                    time.sleep(5)
                    iso.proxy.restore()
                    events.append(f"{second}s broker connections cut for 5 s")
                else:
                    devservices.stop_postgres(iso.services)
                    devservices.start_postgres(iso.services, durable=False)
                    events.append(f"{second}s PostgreSQL restarted")
            for writer in writers:
                assert writer.wait(60) == 0
            wait_until(lambda: undelivered(iso) == 0, 120, "every committed message delivered")
        finally:
            for process in relays + writers:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in relays + writers:
                process.wait(30)

        outcomes = {}
        for n in range(WRITERS):
            for line in (tmp_path / f"writer-{n}.jsonl").read_text().splitlines():
                entry = json.loads(line)
                outcomes[entry["tag"]] = entry["outcome"]
        with iso.engine.connect() as conn:
            committed = {row.id: (bytes(row.key), json.loads(row.payload)["tag"])
                         for row in conn.execute(text(
                             "SELECT id, key, payload FROM outbox.message ORDER BY id"))}
        records = read_topic(settings.kafka_bootstrap, iso.topic, timeout=60)

    seen = Counter(r.message_id for r in records)
    missing = set(committed) - set(seen)
    unknown = set(seen) - set(committed)
    rolled_back = {tag for tag, outcome in outcomes.items() if outcome == "rollback"}
    leaked = {json.loads(r.value)["tag"] for r in records} & rolled_back
    firsts: dict[bytes, list[int]] = {}
    done: set[int] = set()
    for record in records:
        assert record.message_id is not None and record.key is not None
        if record.message_id not in done:
            done.add(record.message_id)
            firsts.setdefault(record.key, []).append(record.message_id)
    out_of_order = [key for key, ids in firsts.items() if ids != sorted(ids)]
    duplicates = sum(n - 1 for n in seen.values())
    summary = (f"chaos: {len(committed)} committed, {len(rolled_back)} rolled back, "
               f"{sum(o == 'uncertain' for o in outcomes.values())} uncertain; "
               f"{len(records)} records in Kafka, {duplicates} duplicates; events: "
               + "; ".join(events))
    print(summary)
    assert len(committed) > 1000, summary
    assert not missing, f"committed but never delivered: {sorted(missing)[:10]} ({summary})"
    assert not unknown, f"in Kafka without a committed prepare row: {sorted(unknown)[:10]}"
    assert not leaked, f"rolled-back messages reached Kafka: {sorted(leaked)[:10]}"
    assert not out_of_order, f"per-key order broken for {out_of_order[:5]}"
    assert duplicates <= 5 * 4 * 200, "at most four batches of 200 per kill or outage"


def start_relay(iso: Isolated, n: int) -> subprocess.Popen[str]:
    return start_outbox(iso.settings, "relay", OUTBOX_WORKER_ID=f"chaos-{n}-{time.time_ns()}",
                        OUTBOX_RELAY_LEASE_SECONDS="2", OUTBOX_RELAY_BATCH_SIZE="200",
                        OUTBOX_LOG_LEVEL="WARNING")


def undelivered(iso: Isolated) -> int:
    with iso.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM outbox.message_state WHERE status <> 'DELIVERED'")).scalar_one())
