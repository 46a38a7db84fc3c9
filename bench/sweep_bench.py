"""Sweeper benchmark: finding due rows is an index lookup, so history does not slow it.

    python bench/sweep_bench.py [--due 10000] [--history 1000000] [--rounds 2]

On durable embedded services (fsync on), sweeps --due UNKNOWN rows — a trivial Python
checker answers COMMIT, so the sweeper's own cost is measured — once in an empty schema and
once in a schema that also holds --history delivered rows and their op records. Prints the
best of --rounds for each, their ratio, and the buffers one claim of 500 rows touches.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, text

from outbox import Message, migrate, store
from outbox.dev import services as devservices
from outbox.relay.sweeper import CLAIM_MARGIN, Sweeper
from outbox.schema import SHARDS
from outbox.settings import Settings, sqlalchemy_url

GROUP = "bench"


def say(line: str) -> None:
    print(line, flush=True)


def commit(message: Message, conn: Connection) -> str:
    return "COMMIT"


def load_history(engine: Engine, schema: str, n: int) -> None:
    """Delivered rows with their op records, as a long-running outbox keeps them."""
    with engine.begin() as conn:
        conn.execute(text(f"""
            WITH written AS (
                INSERT INTO {schema}.message (topic, key, payload, content_type, shard, created_at)
                SELECT 'orders', convert_to('key-' || (i % 1000), 'UTF8'),
                       convert_to(repeat('x', 200), 'UTF8'), 'application/octet-stream',
                       i % {SHARDS}, now() - interval '1 hour'
                FROM generate_series(1, :n) AS i
                RETURNING id
            )
            INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition,
                                            kafka_offset)
            SELECT id, 'DELIVERED', 'bench', id % 3, id FROM written"""), {"n": n})


def load_due(engine: Engine, schema: str, n: int) -> None:
    """UNKNOWN prepare rows whose first check-back is due now."""
    with engine.begin() as conn:
        conn.execute(text(f"""
            WITH written AS (
                INSERT INTO {schema}.message (producer_group, topic, payload, content_type,
                                              shard)
                SELECT :group, 'orders', convert_to('{{"order": ' || i || '}}', 'UTF8'),
                       'application/json', i % {SHARDS}
                FROM generate_series(1, :n) AS i
                RETURNING id, producer_group, topic, shard, created_at
            )
            INSERT INTO {schema}.pending (message_id, shard, topic, producer_group, status,
                                          resolution, next_check_at, created_at)
            SELECT id, shard, topic, producer_group, 'PENDING', 'UNKNOWN',
                   now() - interval '1 second', created_at
            FROM written"""), {"group": GROUP, "n": n})


def vacuum_analyze(engine: Engine, schema: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("message", "pending", "op_record"):
            conn.execute(text(f"VACUUM ANALYZE {schema}.{table}"))


def claim_buffers(engine: Engine, schema: str) -> tuple[int, int]:
    """Shared buffers one claim of 500 due rows touches: finding them (the index lookup),
    and the whole claim, which also updates them (rolled back here)."""
    claim = store.query("claim_checks", schema)
    with engine.connect() as conn, conn.begin() as transaction:
        plan: Any = conn.execute(
            text(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {claim.text}"),
            {"groups": [GROUP], "limit": 500, "claim_seconds": 5 + CLAIM_MARGIN},
        ).scalar_one()
        transaction.rollback()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    find = next(p for p in top["Plans"] if p.get("Subplan Name") == "CTE due")
    return _buffers(find), _buffers(top)


def _buffers(node: dict[str, Any]) -> int:
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


def unresolved(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT count(*) FROM {schema}.pending "
            f"WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')")).scalar_one())


def sweep_all(settings: Settings, engine: Engine) -> float:
    """Seconds for one sweeper to resolve every due row."""
    sweeper = Sweeper(settings, {GROUP: commit})
    thread = threading.Thread(target=sweeper.run, daemon=True)
    started = time.perf_counter()
    thread.start()
    try:
        while unresolved(engine, settings.schema_name):
            time.sleep(0.02)
        return time.perf_counter() - started
    finally:
        sweeper.stop()
        thread.join(60)


def run_case(services: devservices.Services, engine: Engine, schema: str, history: int,
             due: int, rounds: int) -> tuple[float, tuple[int, int]]:
    migrate.upgrade(services.database_url, schema)
    if history:
        started = time.perf_counter()
        load_history(engine, schema, history)
        say(f"   loaded {history:,} delivered rows and op records in "
            f"{time.perf_counter() - started:.1f} s")
    settings = Settings(database_url=services.database_url, schema_name=schema,
                        sweep_poll_interval=0.05)
    timings, buffers = [], (0, 0)
    for _ in range(rounds):
        load_due(engine, schema, due)
        vacuum_analyze(engine, schema)
        buffers = claim_buffers(engine, schema)
        timings.append(sweep_all(settings, engine))
    return min(timings), buffers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    say("starting durable embedded PostgreSQL (fsync on)")
    services = devservices.start(durable=True)
    engine = create_engine(sqlalchemy_url(services.database_url))
    try:
        say(f"sweeping {args.due:,} due rows, no history")
        empty, empty_buffers = run_case(services, engine, "sweep_empty", 0, args.due,
                                        args.rounds)
        say(f"   {empty:.2f} s ({args.due / empty:,.0f} checks/s); claiming 500: "
            f"{empty_buffers[0]} buffers to find them, {empty_buffers[1]} in all")
        say(f"sweeping {args.due:,} due rows next to {args.history:,} delivered rows")
        full, full_buffers = run_case(services, engine, "sweep_history", args.history, args.due,
                                      args.rounds)
        say(f"   {full:.2f} s ({args.due / full:,.0f} checks/s); claiming 500: "
            f"{full_buffers[0]} buffers to find them, {full_buffers[1]} in all")
        say(f"ratio with history / without: time {full / empty:.2f}, buffers to find "
            f"{full_buffers[0] / max(empty_buffers[0], 1):.2f}, to claim "
            f"{full_buffers[1] / max(empty_buffers[1], 1):.2f}")
    finally:
        engine.dispose()
        devservices.stop(services)


if __name__ == "__main__":
    main()
