"""The long haul (issue 12 §6): a steady publish rate for ``SOAK_MINUTES`` (2 by
default; BENCHMARKS.md records a 15-minute run), two relays restarted in turn every
``SOAK_RESTART_SECONDS`` (40 by default: SIGTERM and kill -9 alternating, each relay at least
once) and retention of one minute over history partitions of about 20 s of load each.

Asserted: nothing lost or doubled in the books (every id has exactly one DELIVERED op record,
audited by a trigger since retention deletes the op records themselves) and every id is on the
topic; each relay's RSS and the database's connection count stay bounded. Latency percentiles
per minute are printed, not asserted: on a shared 2-core machine their trend follows the
neighbours' load as much as the relay, so a bound on it would fail for reasons outside the code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import quantiles

import pytest
from sqlalchemy import Engine, text

from outbox.dev.topics import read_topic
from tests.conftest import wait_until
from tests.isolated import Isolated, isolated_services

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from relay_bench import start_relays
from soak import write_load

MINUTES = float(os.environ.get("SOAK_MINUTES", "2"))
RESTART_SECONDS = float(os.environ.get("SOAK_RESTART_SECONDS", "40"))
RATE = float(os.environ.get("SOAK_RATE", "300"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(MINUTES * 60 + 360)]
RELAYS = 2
#: Message ids per history partition: about 20 s of load, so retention (one minute) drops
#: partitions throughout the run.
PARTITION_SIZE = int(RATE * 20)
SAMPLE_SECONDS = 5.0
#: A relay's resident memory may not grow by more than this over its life (after its first
#: 20 seconds), nor exceed RSS_CEILING_MB at any time.
RSS_GROWTH_MB = 40.0
RSS_CEILING_MB = 400.0


@dataclass
class Slot:
    """One relay position: the process in it now, restarted in turn."""

    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    #: (seconds into the run, RSS in MB) of the current process
    rss: list[tuple[float, float]] = field(default_factory=list)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def audit(engine: Engine, schema: str) -> None:
    """Copy every op record as it is inserted (with its message's creation time) into a
    table retention does not prune."""
    with engine.begin() as conn:
        conn.execute(text(f"""
            CREATE TABLE {schema}.soak_audit (message_id bigint, action text,
                                              created_at timestamptz, acked_at timestamptz);
            CREATE FUNCTION {schema}.soak_audit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {schema}.soak_audit
                SELECT NEW.message_id, NEW.action, m.created_at, NEW.created_at
                FROM {schema}.message AS m WHERE m.id = NEW.message_id;
                RETURN NEW;
            END $$;
            CREATE TRIGGER soak_audit AFTER INSERT ON {schema}.op_record
                FOR EACH ROW EXECUTE FUNCTION {schema}.soak_audit();"""))


def connections(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        ).scalar_one())


def test_soak(tmp_path: Path) -> None:
    with isolated_services(partitions=6, partition_size=PARTITION_SIZE) as iso:
        schema = "outbox"
        audit(iso.engine, schema)
        env = {**os.environ, **iso.services.env(),
               "OUTBOX_RETENTION_HOURS": str(60 / 3600), "OUTBOX_PRUNE_INTERVAL": "10",
               "OUTBOX_PARTITION_SIZE": str(PARTITION_SIZE),
               "OUTBOX_RELAY_LEASE_SECONDS": "3", "OUTBOX_RELAY_POLL_INTERVAL": "0.2"}
        slots = [Slot(p) for p in start_relays(env, schema, RELAYS)]
        started = time.monotonic()
        stop_at = time.perf_counter() + MINUTES * 60
        load = threading.Thread(target=write_load,
                                args=(iso.engine, schema, iso.topic, RATE, stop_at))
        samples: dict[int, list[tuple[str, float]]] = defaultdict(list)
        events: list[str] = []
        grown: list[str] = []
        try:
            load.start()
            next_restart, turn = started + RESTART_SECONDS, 0
            while load.is_alive():
                time.sleep(SAMPLE_SECONDS)
                now = time.monotonic()
                minute = int((now - started) // 60) + 1
                for n, slot in enumerate(slots):
                    rss = rss_mb(slot.process.pid)
                    if rss is not None:
                        slot.rss.append((now - slot.started, rss))
                        samples[minute].append((f"relay {n}", rss))
                samples[minute].append(("connections", connections(iso.engine)))
                if now >= next_restart:
                    slot = slots[turn % RELAYS]
                    grown += rss_growth(slot, f"relay {turn % RELAYS}")
                    how = signal.SIGTERM if turn % 2 == 0 else signal.SIGKILL
                    slot.process.send_signal(how)
                    slot.process.wait(60)
                    slots[turn % RELAYS] = Slot(start_relays(env, schema, 1)[0])
                    events.append(f"{now - started:.0f}s {how.name} relay {turn % RELAYS}")
                    next_restart, turn = now + RESTART_SECONDS, turn + 1
            load.join()
            last_id = published(iso)
            wait_until(lambda: delivered_ids(iso.engine) >= last_id, 120,
                       "every published message delivered")
        finally:
            for slot in slots:
                slot.process.send_signal(signal.SIGTERM)
            for slot in slots:
                slot.process.wait(60)
        for n, slot in enumerate(slots):
            grown += rss_growth(slot, f"relay {n}")
        report = table(iso.engine, schema, samples, started)
        records = read_topic(iso.settings.kafka_bootstrap, iso.topic, timeout=120)
        with iso.engine.connect() as conn:
            per_id = conn.execute(text(
                f"SELECT message_id, count(*) FROM {schema}.soak_audit "
                "WHERE action = 'DELIVERED' GROUP BY 1")).all()
            kept = int(conn.execute(text(f"SELECT count(*) FROM {schema}.op_record")).scalar_one())

    print(f"\nsoak: {MINUTES:g} min at {RATE:g} msg/s, {last_id} messages, "
          f"{len(records) - len({r.message_id for r in records})} duplicates on the topic, "
          f"{last_id - kept} op records pruned by retention; "
          f"events: {'; '.join(events)}\n{report}")
    every = set(range(1, last_id + 1))
    assert last_id >= RATE * MINUTES * 60 * 0.5, "the load was written"
    assert {m for m, _ in per_id} == every, "every message got a DELIVERED op record"
    assert not [m for m, n in per_id if n != 1], "exactly one DELIVERED op record each"
    assert kept < last_id, "retention pruned the oldest op records"
    assert {r.message_id for r in records} == every, "every message is on the topic"
    assert not grown, f"relay memory grew: {grown}"
    peaks = [max(rss for name, rss in row if name != "connections") for row in samples.values()]
    assert max(peaks) <= RSS_CEILING_MB
    counts = [[c for name, c in samples[m] if name == "connections"] for m in sorted(samples)]
    assert max(counts[-1]) <= max(counts[0]) + 4, f"connections grew: {counts}"


def published(iso: Isolated) -> int:
    """The last message id, read as the load ends (before retention can prune it); ids are
    gapless here: one writer, and every transaction commits."""
    with iso.engine.connect() as conn:
        return int(conn.execute(text("SELECT max(id) FROM outbox.message")).scalar_one())


def delivered_ids(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(DISTINCT message_id) FROM outbox.soak_audit "
            "WHERE action = 'DELIVERED'")).scalar_one())


def rss_growth(slot: Slot, name: str) -> list[str]:
    """The process's RSS growth after its first 20 seconds, if beyond the bound."""
    settled = [rss for at, rss in slot.rss if at >= 20]
    if len(settled) < 2 or settled[-1] - settled[0] <= RSS_GROWTH_MB:
        return []
    return [f"{name}: {settled[0]:.0f} -> {settled[-1]:.0f} MB"]


def table(engine: Engine, schema: str, samples: dict[int, list[tuple[str, float]]],
          started: float) -> str:
    """Per minute: messages, commit -> recorded ack p50/p99/max, each relay's peak RSS and
    the peak connection count."""
    with engine.connect() as conn:
        rows = conn.execute(text(f"""
            SELECT created_at, extract(epoch FROM acked_at - created_at) * 1000 AS ms
            FROM {schema}.soak_audit WHERE action = 'DELIVERED' ORDER BY created_at""")).all()
    first = rows[0].created_at if rows else None
    latencies: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        latencies[int((row.created_at - first).total_seconds() // 60) + 1].append(row.ms)
    names = sorted({name for row in samples.values() for name, _ in row if name != "connections"})
    lines = ["| minute | messages | p50 | p99 | max | " + " | ".join(
        f"{n} RSS" for n in names) + " | connections |",
        "|---" * (6 + len(names)) + "|"]
    for minute in sorted(latencies):
        ms = sorted(latencies[minute])
        cuts = quantiles(ms, n=100) if len(ms) > 1 else [ms[0]] * 99
        row = samples.get(minute, [])
        rss = [max((v for n, v in row if n == name), default=0.0) for name in names]
        conns = max((v for n, v in row if n == "connections"), default=0)
        lines.append(f"| {minute} | {len(ms):,} | {cuts[49]:.1f} ms | {cuts[98]:.1f} ms | "
                     f"{ms[-1]:.1f} ms | " + " | ".join(f"{r:.0f} MB" for r in rss)
                     + f" | {conns:.0f} |")
    return "\n".join(lines)
