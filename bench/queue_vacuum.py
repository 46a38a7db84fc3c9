"""What a VACUUM of a drained ``pending`` costs the publishers, with and without truncation.

    python bench/queue_vacuum.py [--rows 2000000] [--rounds 2]

Each round, for each variant (``pending`` as built, ``vacuum_truncate = false`` since
revision 0013; and with ``vacuum_truncate = true``, as before it), on fresh durable embedded
PostgreSQL with autovacuum off: ``--rows`` pending rows are written, the first half deleted
and vacuumed (new rows then go to its front, as in a queue at work), four publishers start
(one message per transaction, 2 ms apart), the second half is deleted (the drain ends) and
``pending`` is vacuumed while they publish. Printed: the table's size before and after, the
VACUUM's time, and the publishers' commits during it (p50, slowest) next to the commits
before it.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from relay_bench import drop_schema, preload, say
from soak import fresh_services
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.dev import services as devservices

VARIANTS = {"kept (as built)": "false", "truncated (before 0013)": "true"}


def publishers(engine: Engine, schema: str, stop: threading.Event,
               commits: list[tuple[float, float]], threads: int = 4) -> list[threading.Thread]:
    """Started threads publishing until ``stop``; each commit's (end, seconds) into
    ``commits``."""
    outbox = Outbox(schema=schema)

    def publish() -> None:
        with Session(engine) as session:
            while not stop.is_set():
                t0 = time.perf_counter()
                with session.begin():
                    outbox.publish(session, "t", b"x" * 1024, key="k")
                commits.append((time.perf_counter(), time.perf_counter() - t0))
                time.sleep(0.002)

    workers = [threading.Thread(target=publish) for _ in range(threads)]
    for w in workers:
        w.start()
    return workers


def one_round(services: devservices.Services, engine: Engine, conn: Connection, schema: str,
              truncate: str, rows: int) -> str:
    migrate.upgrade(services.database_url, schema)
    conn.execute(text(f"ALTER TABLE {schema}.pending SET (vacuum_truncate = {truncate})"))
    preload(engine, schema, "t", rows)
    first, last = conn.execute(text(
        f"SELECT min(message_id), max(message_id) FROM {schema}.pending")).one()
    half = first + rows // 2
    conn.execute(text(f"DELETE FROM {schema}.pending WHERE message_id < :half"),
                 {"half": half})
    conn.execute(text(f"VACUUM (TRUNCATE false) {schema}.pending"))
    stop, commits = threading.Event(), list[tuple[float, float]]()
    workers = publishers(engine, schema, stop, commits)
    try:
        time.sleep(1)
        conn.execute(text(f"DELETE FROM {schema}.pending WHERE message_id BETWEEN :half "
                          "AND :last"), {"half": half, "last": last})
        time.sleep(1)
        size = text(f"SELECT pg_relation_size('{schema}.pending') / 1e6")
        before = conn.execute(size).scalar_one()
        started = time.perf_counter()
        conn.execute(text(f"VACUUM {schema}.pending"))
        ended = time.perf_counter()
        time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join()
    after = conn.execute(size).scalar_one()
    during = sorted(s for at, s in commits if started <= at <= ended + 0.3)
    earlier = sorted(s for at, s in commits if at < started)
    return (f"pending {before:6.1f} → {after:6.1f} MB, VACUUM {ended - started:5.2f} s; "
            f"{len(during)} commits during it: p50 {statistics.median(during) * 1000:5.2f} ms, "
            f"slowest {during[-1] * 1000:6.1f} ms (before it: p50 "
            f"{statistics.median(earlier) * 1000:5.2f} ms, slowest "
            f"{earlier[-1] * 1000:6.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with fresh_services(pool_size=8) as (services, engine), \
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ALTER SYSTEM SET autovacuum = off"))
        conn.execute(text("SELECT pg_reload_conf()"))
        for n in range(1, args.rounds + 1):
            for variant, truncate in VARIANTS.items():
                schema = f"queue_vacuum_{n}_{truncate}"
                say(f"round {n}, {variant:23}: "
                    f"{one_round(services, engine, conn, schema, truncate, args.rows)}")
                drop_schema(engine, schema)


if __name__ == "__main__":
    main()
