"""A chaos run: writers commit and roll back at random while relays are killed with -9 and
restarted, the broker's connections are cut and PostgreSQL restarts; then a verdict on what
reached Kafka (tests/integration/test_chaos*.py assert on it)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import text

from outbox.dev import services as devservices
from outbox.dev.topics import Record, read_topic
from tests.conftest import wait_until
from tests.isolated import Isolated, isolated_services
from tests.processes import OutboxProcess, start_outbox

#: The relays' log lines a failed verdict shows (relay/leases.py, relay/recovery.py, passes).
TOLD = (" owns ", " settled ", " handed back ", " paused", "delivering again", "cannot renew",
        "renewals work again", " started: ", " stopped ")


@dataclass
class Verdict:
    committed: int
    rolled_back: int
    records: int
    duplicates: int
    missing: list[int]
    unknown: list[int]
    leaked: list[str]
    out_of_order: list[bytes]
    events: list[str] = field(default_factory=list)
    #: what a failed verdict needs to be understood (see :func:`evidence`); empty if none
    evidence: str = ""

    @property
    def summary(self) -> str:
        kills = sum("kill" in event for event in self.events)
        return (f"chaos: {self.committed} committed, {self.rolled_back} rolled back; "
                f"{self.records} records in Kafka, {self.duplicates} duplicates; {kills} kills; "
                "events: " + "; ".join(self.events))


def run_chaos(tmp_path: Path, schedule: list[tuple[float, str]], *, writers: int = 3,
              relays: int = 3, seconds: float = 25, sizes: str = "1,1,2,3",
              at_least: int = 0, seed: int = 20261122) -> Verdict:
    """Run the writers for ``seconds`` (and on until they committed ``at_least`` messages
    between them, on a slow machine) and the ``schedule`` of ``(second, action)``, action
    one of ``kill`` (a random relay, restarted soon after), ``cut`` (the broker's
    connections, for 5 s) and ``restart-postgres``; wait for every committed message."""
    rng = random.Random(seed)
    with isolated_services(partitions=6) as iso:
        relaying = Relays(iso, relays)
        running = relaying.running
        share = -(-at_least // writers)
        writing = [start_writer(iso, tmp_path, n, seconds, sizes, share)
                   for n in range(writers)]
        events: list[str] = []
        try:
            started = time.monotonic()
            for second, action in schedule:
                time.sleep(max(0.0, started + second - time.monotonic()))
                events.append(f"{second}s " + act(iso, action, relaying, rng))
            for writer in writing:
                assert writer.wait(5 * seconds + 60) == 0
            wait_until(lambda: undelivered(iso) == 0, 180, "every committed message delivered")
        finally:
            for process in running + writing:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in running + writing:
                process.wait(30)
        with iso.engine.connect() as conn:
            committed = {row.id: json.loads(row.payload)["tag"] for row in conn.execute(text(
                "SELECT id, payload FROM outbox.message ORDER BY id"))}
        records = read_topic(iso.settings.kafka_bootstrap, iso.topic, timeout=120)
        verdict = judge(tmp_path, writers, committed, records, events)
        if verdict.duplicates or verdict.missing or verdict.out_of_order:
            verdict.evidence = evidence(iso, records, relaying)
    return verdict


def act(iso: Isolated, action: str, relays: Relays, rng: random.Random) -> str:
    if action == "kill":
        victim = rng.randrange(len(relays.running))
        relays.running[victim].kill()
        relays.running[victim].wait()
        time.sleep(rng.uniform(0.2, 1.5))
        relays.running[victim] = relays.start(victim)
        return f"kill -9 relay {victim}, restarted"
    if action == "cut":
        iso.proxy.cut()
        time.sleep(5)
        iso.proxy.restore()
        return "broker connections cut for 5 s"
    devservices.stop_postgres(iso.services)
    devservices.start_postgres(iso.services, durable=False)
    return "PostgreSQL restarted"


def judge(tmp_path: Path, writers: int, committed: dict[int, str], records: list[Record],
          events: list[str]) -> Verdict:
    outcomes = {}
    for n in range(writers):
        for line in (tmp_path / f"writer-{n}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            outcomes[entry["tag"]] = entry["outcome"]
    seen = Counter(r.message_id for r in records)
    rolled_back = {tag for tag, outcome in outcomes.items() if outcome == "rollback"}
    firsts: dict[bytes, list[int]] = {}
    done: set[int] = set()
    for record in records:
        assert record.message_id is not None and record.key is not None
        if record.message_id not in done:
            done.add(record.message_id)
            firsts.setdefault(record.key, []).append(record.message_id)
    return Verdict(
        committed=len(committed), rolled_back=len(rolled_back), records=len(records),
        duplicates=sum(n - 1 for n in seen.values()),
        missing=sorted(set(committed) - set(seen)),
        unknown=sorted(id_ for id_ in set(seen) - set(committed) if id_ is not None),
        leaked=sorted({json.loads(r.value)["tag"] for r in records} & rolled_back),
        out_of_order=[key for key, ids in firsts.items() if ids != sorted(ids)],
        events=events)


class Relays:
    """The run's relays: ``running``, the live one of each slot; every one started is kept,
    and its log with it (an :class:`OutboxProcess` deletes its log once it is let go)."""

    def __init__(self, iso: Isolated, count: int) -> None:
        self.iso = iso
        self.started: list[OutboxProcess] = []
        self.running = [self.start(n) for n in range(count)]

    def start(self, n: int) -> OutboxProcess:
        relay = start_outbox(self.iso.settings, "relay",
                             OUTBOX_WORKER_ID=f"chaos-{n}-{time.time_ns()}",
                             OUTBOX_RELAY_LEASE_SECONDS="2", OUTBOX_RELAY_BATCH_SIZE="200",
                             OUTBOX_LOG_LEVEL="INFO")
        self.started.append(relay)
        return relay

    def told(self) -> list[str]:
        """Their lines about shards, passes and settling, in time order."""
        return sorted(line for relay in self.started
                      for line in Path(relay.log).read_text().splitlines()
                      if any(word in line for word in TOLD))


def evidence(iso: Isolated, records: list[Record], relays: Relays) -> str:
    """Each message in Kafka more than once (the first 10): where its copies are, its op
    records and its shard; then what the relays said, in time order. CI's duplicates of
    stop 61 were understood only once reproduced with these (docs/guarantees.md)."""
    copies: dict[int, list[str]] = {}
    for record in records:
        if record.message_id is not None:
            copies.setdefault(record.message_id, []).append(f"{record.partition}:{record.offset}")
    lines = []
    with iso.engine.connect() as conn:
        for message_id in sorted(m for m, where in copies.items() if len(where) > 1)[:10]:
            shard, created = conn.execute(text(
                "SELECT shard, created_at FROM outbox.message WHERE id = :id"),
                {"id": message_id}).one()
            ops = conn.execute(text(
                "SELECT action, actor, kafka_partition, kafka_offset, created_at "
                "FROM outbox.op_record WHERE message_id = :id ORDER BY id"),
                {"id": message_id}).all()
            lines.append(
                f"message {message_id} (shard {shard}, created {created:%H:%M:%S.%f}) in Kafka "
                f"at {', '.join(copies[message_id])}; op records: " + "; ".join(
                    f"{op.action} by {op.actor} at {op.kafka_partition}:{op.kafka_offset} "
                    f"{op.created_at:%H:%M:%S.%f}" for op in ops))
    return "\n".join(lines + relays.told())


def start_writer(iso: Isolated, tmp_path: Path, n: int, seconds: float, sizes: str,
                 at_least: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.chaos_writer", "--url",
                             iso.settings.database_url, "--schema", "outbox", "--topic",
                             iso.topic, "--seconds", str(seconds), "--seed", str(n), "--sizes",
                             sizes, "--at-least", str(at_least),
                             "--out", str(tmp_path / f"writer-{n}.jsonl")])


def undelivered(iso: Isolated) -> int:
    with iso.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM outbox.message_state WHERE status <> 'DELIVERED'")).scalar_one())
