"""What many topics cost the relay: a first delivery to topics it has not seen, and noting
the reasons of held topics on their rows.

    python bench/many_topics_bench.py [--topics 3000] [--client kafka-python] [--rows 20000]

* **First delivery:** one committed 1 KiB message to each of ``--topics`` topics new to the
  relay (the embedded broker creates each when first asked about it), one relay; printed:
  the seconds until all are delivered (at most ``--seconds``), and the lines logged at INFO
  and above, by their first words.
* **Marks:** as many topics held at once, over ``--rows`` pending rows of them: the reasons
  noted with one UPDATE per topic (the statement the relay ran before session 46), then
  with one for all (``store.mark_held``, which since revision 0024 also flags the rows
  ``held``, and notes only rows not flagged yet: they are unflagged before each of its
  runs), twice each in turn; printed with their ratio.

On fresh embedded services (not durable: nothing here waits for the disk). Prints only.
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import threading
import time

from relay_bench import PAYLOAD, bulk_publish, say
from sqlalchemy import Engine, create_engine, text

from outbox import migrate, store
from outbox.dev import services as devservices
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url

#: The relay's statement before session 46: one per held topic.
PER_TOPIC = """UPDATE {schema}.pending SET last_error = :reason
WHERE topic = :topic AND status = 'PENDING' AND resolution = 'COMMIT'
  AND shard = ANY(CAST(:shards AS smallint[])) AND last_error IS DISTINCT FROM :reason"""


class Lines(logging.Handler):
    """The lines at INFO and above, counted by their first four words (the first of each
    kept)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: collections.Counter[str] = collections.Counter()
        self.first: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        words = " ".join(line.split()[:4])
        self.counts[words] += 1
        self.first.setdefault(words, line)


def first_delivery(services: devservices.Services, engine: Engine, topics: int,
                   client: str, seconds: float) -> None:
    schema = "first_delivery"
    migrate.upgrade(services.database_url, schema)
    with engine.begin() as conn:
        for i in range(topics):
            conn.execute(bulk_publish(schema), {"topic": f"new-{i}", "payload": PAYLOAD,
                                                "n": 1, "status": "PENDING"})
    lines = Lines()
    logging.getLogger().addHandler(lines)
    relay = Relay(Settings(database_url=services.database_url,
                           kafka_bootstrap=services.kafka_bootstrap, schema_name=schema,
                           kafka_client=client, relay_poll_interval=0.2))
    thread = threading.Thread(target=relay.run, daemon=True)
    start = time.monotonic()
    thread.start()
    delivered = 0
    while time.monotonic() - start < seconds:
        with engine.connect() as conn:
            delivered = topics - conn.execute(
                text(f"SELECT count(*) FROM {schema}.pending")).scalar_one()
        if delivered == topics:
            break
        time.sleep(0.5)
    took = time.monotonic() - start
    relay.stop()
    thread.join(60)
    logging.getLogger().removeHandler(lines)
    say(f"first delivery to {topics:,} new topics ({client}): {delivered:,} delivered in "
        f"{took:.1f}s")
    for words, n in lines.counts.most_common(12):
        say(f"  {n:5} x {lines.first[words][:300]}")


def marks(services: devservices.Services, engine: Engine, topics: int, rows: int) -> None:
    schema = "marks"
    migrate.upgrade(services.database_url, schema)
    with engine.begin() as conn:
        for i in range(topics):
            conn.execute(bulk_publish(schema), {"topic": f"held-{i}", "payload": b"",
                                                "n": max(1, rows // topics),
                                                "status": "PENDING"})
        conn.execute(text(f"ANALYZE {schema}.pending"))
    shards = store.int_array(range(64))
    per_topic, one = [], []
    for n in range(2):
        with engine.begin() as conn:
            start = time.perf_counter()
            for i in range(topics):
                conn.execute(text(PER_TOPIC.format(schema=schema)), {
                    "topic": f"held-{i}", "reason": f"held: {n} a", "shards": shards})
            per_topic.append(time.perf_counter() - start)
        with engine.begin() as conn:  # the rows the relay would note: not flagged yet
            conn.execute(text(f"UPDATE {schema}.pending SET held = false"))
        with engine.begin() as conn:
            start = time.perf_counter()
            store.mark_held(conn, schema, {f"held-{i}": f"held: {n} b" for i in range(topics)},
                            range(64), limit=rows)
            one.append(time.perf_counter() - start)
        say(f"marks, round {n + 1}: {topics:,} held topics over {rows:,} rows: one statement "
            f"per topic {per_topic[-1] * 1000:,.0f} ms, one for all {one[-1] * 1000:,.0f} ms")
    say(f"marks: one for all takes {statistics.median(one) / statistics.median(per_topic):.3f}"
        f"x the time of one per topic (medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=3000)
    parser.add_argument("--client", default="kafka-python")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.INFO)
    services = devservices.start()
    engine = create_engine(sqlalchemy_url(services.database_url))
    try:
        first_delivery(services, engine, args.topics, args.client, args.seconds)
        marks(services, engine, args.topics, args.rows)
    finally:
        engine.dispose()
        devservices.stop(services)


if __name__ == "__main__":
    main()
