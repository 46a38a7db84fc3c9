"""What one console page costs the database: the time of its read (outbox.console.overview,
one read-only snapshot) with N deliveries in the last hour of history: a full read (the
hour's totals and percentiles, as on a console's first page and once a minute after) and a
refresh (only the last two minutes of deliveries).

    python bench/console_bench.py [--deliveries 100000 1000000] [--repeat 5]

On fresh embedded services: for each N, N delivered messages (message rows and DELIVERED op
records spread over the last hour, written by SQL as a relay would leave them) plus a day of
older history of the same size, then the page's read timed --repeat times (the first, cold,
reported apart), full and refreshing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sqlalchemy import create_engine, text

from outbox import migrate
from outbox.console.overview import Deliveries, HeldFilter, read
from outbox.dev import services as devservices
from outbox.settings import Settings, sqlalchemy_url

HISTORY = """
INSERT INTO {schema}.message (topic, key, payload, content_type, shard, created_at)
SELECT 'orders', convert_to('k' || (g % 1000), 'UTF8'), convert_to(repeat('x', 200), 'UTF8'),
       'application/json', g % 64, now() - make_interval(secs => :age_from + :span * (g - 1) / :n)
FROM generate_series(1, :n) AS g;
INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, kafka_offset,
                                created_at)
SELECT id, 'DELIVERED', 'bench', 0, id, created_at + interval '20 milliseconds'
FROM {schema}.message WHERE id > :after;
"""


def fill(engine_url: str, schema: str, n: int) -> None:
    engine = create_engine(sqlalchemy_url(engine_url))
    with engine.begin() as conn:
        for age_from, span in ((3700.0, 86400.0), (1.0, 3500.0)):  # a day before, the hour
            after = conn.execute(text(
                f"SELECT coalesce(max(id), 0) FROM {schema}.message")).scalar_one()
            for statement in HISTORY.format(schema=schema).strip().split(";\n"):
                conn.execute(text(statement), {"n": n, "age_from": age_from, "span": span,
                                               "after": after})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            f"VACUUM ANALYZE {schema}.message, {schema}.op_record")
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deliveries", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    services = devservices.start(durable=True)
    try:
        for n in args.deliveries:
            schema = f"console_{n}"
            migrate.upgrade(services.database_url, schema)
            fill(services.database_url, schema, n)
            settings = Settings(database_url=services.database_url, schema_name=schema)
            engine = create_engine(settings.sqlalchemy_url)
            kept = Deliveries()
            for kind in ("full", "refresh"):
                times = []
                with engine.connect() as conn:
                    for _ in range(args.repeat + 1):
                        start = time.perf_counter()
                        deliveries = Deliveries() if kind == "full" else kept
                        view = read(conn, settings, HeldFilter(), 10.0, deliveries)
                        times.append(time.perf_counter() - start)
                assert view.window["delivered"] == n, view.window
                print(f"{n:>9,} deliveries in the hour (+{n:,} older), {kind} page read: first "
                      f"{times[0] * 1000:.0f} ms, then median "
                      f"{statistics.median(times[1:]) * 1000:.0f} ms, max "
                      f"{max(times[1:]) * 1000:.0f} ms over {args.repeat}", flush=True)
            engine.dispose()
    finally:
        devservices.stop(services)


if __name__ == "__main__":
    main()
