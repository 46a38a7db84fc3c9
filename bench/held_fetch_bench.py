"""What a held topic's backlog costs the relay's fetch of the other topics.

    python bench/held_fetch_bench.py [--held 0,100000,1000000] [--batch 500] [--repeat 7]

A held topic's rows stay pending (relay/holds.py). Since revision 0024 the relay flags them
``held`` as it notes their reason (``store.mark_held``), which takes them out of the index the
fetch walks; before, the fetch skipped them by their topic alone (queries.sql,
``fetch_deliverable``: ``p.topic <> ALL(:held)``) and walked every one of them older than the
other topics' rows at every fetch. For each size of ``--held`` (cumulative: the rows are added
in turn), 2,000 rows of another topic are written after the held ones, and
``store.fetch_deliverable`` of ``--batch`` rows over all shards is timed ``--repeat`` times:
with the topic held and its rows flagged, with it held by its topic alone (the fetch as
before revision 0024), and with nothing held (then the first rows returned are the held
topic's own, the walk's floor). Also timed once each: flagging the held rows
(``mark_held``), the look of a relay holding nothing for the topics flagged in its shards
(``flagged_topics``, what a relay taking over the shards does), a refused topic's trial (the
first row of each shard unflagged, ``try_held``), and unflagging them (``release_held``).
Printed: the medians, and each fetch over nothing held, measured in the same run, on
sessions set as the relay's delivery connection (``store.DELIVERY_SETTINGS``). Fresh durable
embedded services; prints only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from relay_bench import say
from soak import fresh_services
from sqlalchemy import Connection, Engine, text

from outbox import migrate, store
from outbox.encoding import SHARDS
from outbox.relay.holds import FLAG_BATCH
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


def timed_ms(engine: Engine, step: Callable[[Connection], int]) -> tuple[float, float]:
    """``step`` in a transaction of its own, again while it wrote ``FLAG_BATCH`` rows, as the
    relay's steps do: the milliseconds of them all, and of the longest."""
    times = []
    while True:
        started = time.perf_counter()
        with engine.begin() as conn:
            written = step(conn)
        times.append((time.perf_counter() - started) * 1000)
        if written < FLAG_BATCH:
            return sum(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", default="0,100000,1000000")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with fresh_services(pool_size=2) as (services, _):
        migrate.upgrade(services.database_url, SCHEMA)
        engine = store.engine(sqlalchemy_url(services.database_url),
                              settings=store.DELIVERY_SETTINGS)  # as the relay's
        try:
            total = 0
            for size in map(int, args.held.split(",")):
                write(engine, "held", size - total)
                total = size
                with engine.begin() as conn:
                    conn.execute(text(f"DELETE FROM {SCHEMA}.pending WHERE topic = 'other'"))
                write(engine, "other", 2_000)
                free = fetch_ms(engine, args.batch, [], args.repeat)
                by_topic = fetch_ms(engine, args.batch, ["held"], args.repeat)
                mark, mark_step = timed_ms(engine, lambda conn: store.mark_held(
                    conn, SCHEMA, {"held": "held: by the benchmark"}, range(SHARDS),
                    FLAG_BATCH))
                flagged = fetch_ms(engine, args.batch, ["held"], args.repeat)
                heal, _ = timed_ms(engine, lambda conn: len(store.flagged_topics(
                    conn, SCHEMA, [], range(SHARDS))))
                trial, _ = timed_ms(engine, lambda conn: store.try_held(
                    conn, SCHEMA, ["held"], range(SHARDS)))
                release, release_step = timed_ms(engine, lambda conn: store.release_held(
                    conn, SCHEMA, ["held"], range(SHARDS), FLAG_BATCH))
                say(f"{total:>9,} held rows ahead, fetch of {args.batch} rows: flagged "
                    f"{flagged:5.1f} ms ({flagged / free:4.1f}x), by topic alone (before 0024) "
                    f"{by_topic:6.1f} ms ({by_topic / free:5.1f}x), nothing held {free:4.1f} ms; "
                    f"flagging them {mark:7.1f} ms (longest step {mark_step:5.1f}), the look "
                    f"for stale flags {heal:4.1f} ms, a trial's first rows {trial:4.1f} ms, "
                    f"unflagging them {release:7.1f} ms "
                    f"(longest step {release_step:5.1f})")
        finally:
            engine.dispose()


if __name__ == "__main__":
    main()
