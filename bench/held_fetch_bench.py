"""What a held topic's backlog costs the relay's fetch of the other topics.

    python bench/held_fetch_bench.py [--held 0,100000,1000000] [--batch 500] [--repeat 7]

A held topic's rows stay pending (relay/holds.py), and the fetch skips them by their topic
(queries.sql, ``fetch_deliverable``: ``p.topic <> ALL(:held)``) while it walks the pending
rows in id order. Rows of a held topic older than the others' are walked by every fetch. For
each size of ``--held`` (cumulative: the rows are added in turn), 2,000 rows of another topic
are written after the held ones, and ``store.fetch_deliverable`` of ``--batch`` rows over all
shards is timed ``--repeat`` times with the topic held and with nothing held (then the first
rows returned are the held topic's own, the walk's floor). Printed: the medians, and held over
nothing held, measured in the same run. Fresh durable embedded services; prints only.
"""

from __future__ import annotations

import argparse
import statistics
import time

from relay_bench import say
from soak import fresh_services
from sqlalchemy import Engine, text

from outbox import migrate, store
from outbox.encoding import SHARDS
from outbox.settings import sqlalchemy_url

SCHEMA = "held_fetch"


def write(engine: Engine, topic: str, n: int) -> None:
    """``n`` committed pending rows of ``topic``, distinct keys, spread over the shards."""
    with engine.begin() as conn:
        conn.execute(text(f"""
            WITH written AS (
                INSERT INTO {SCHEMA}.message (topic, key, payload, content_type, shard)
                SELECT :topic, convert_to('k' || i, 'UTF8'), 'x', 'text/plain', i % {SHARDS}
                FROM generate_series(1, :n) AS i
                RETURNING id, topic, key, shard, created_at)
            INSERT INTO {SCHEMA}.pending
                (message_id, shard, topic, key, producer_group, status, resolution, created_at)
            SELECT id, shard, topic, key, 'default', 'PENDING', 'COMMIT', created_at
            FROM written"""), {"topic": topic, "n": n})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {SCHEMA}.pending"))


def fetch_ms(engine: Engine, batch: int, held: list[str], repeat: int) -> float:
    times = []
    with engine.connect() as conn:
        for _ in range(repeat):
            started = time.perf_counter()
            rows = store.fetch_deliverable(conn, SCHEMA, range(SHARDS), batch, held=held)
            times.append((time.perf_counter() - started) * 1000)
            conn.rollback()
            assert len(rows) == batch and not {row.topic for row in rows} & set(held)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", default="0,100000,1000000")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with fresh_services(pool_size=2) as (services, _):
        migrate.upgrade(services.database_url, SCHEMA)
        engine = store.engine(sqlalchemy_url(services.database_url))
        try:
            total = 0
            for size in map(int, args.held.split(",")):
                write(engine, "held", size - total)
                total = size
                with engine.begin() as conn:
                    conn.execute(text(f"DELETE FROM {SCHEMA}.pending WHERE topic = 'other'"))
                write(engine, "other", 2_000)
                free = fetch_ms(engine, args.batch, [], args.repeat)
                held = fetch_ms(engine, args.batch, ["held"], args.repeat)
                say(f"{total:>9,} held rows ahead: fetch of {args.batch} rows {held:7.1f} ms with "
                    f"the topic held, {free:5.1f} ms with nothing held; {held / free:5.1f}x")
        finally:
            engine.dispose()


if __name__ == "__main__":
    main()
