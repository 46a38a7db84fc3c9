"""Relay benchmarks on the embedded services, each next to a baseline measured in the same run.

    python bench/relay_bench.py [--messages 100000] [--history 1000000]

1. throughput of 1 KiB messages with 1 and 2 relays, with each Kafka client (OUTBOX_KAFKA_CLIENT),
   vs raw kafka-python produce (no database); raw librdkafka produce for reference;
2. the same with --history delivered rows retained in the table (bounded cost);
3. commit -> broker ack latency at a steady 1,000 msg/s (p50, p99);
4. business insert + publish TPS vs business insert alone;
5. table and index sizes after the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from kafka import KafkaProducer
from sqlalchemy import Engine, TextClause, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, store
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay.confluent import librdkafka_config
from outbox.relay.producer import PRODUCER_DEFAULTS, KeyHashPartitioner
from outbox.relay.wakeup import Wakeup
from outbox.schema import SHARDS
from outbox.settings import RelaySettings, sqlalchemy_url

PAYLOAD = b"x" * 1024
KEYS = 1000


def say(line: str) -> None:
    print(line, flush=True)


def raw_produce(bootstrap: str, topic: str, n: int, client: str = "kafka-python",
                key_memo: bool = False) -> float:
    """Records per second of the bare client with the relay's producer settings (kafka-python's
    own partitioner unless ``key_memo``: the relay's KeyHashPartitioner), measured in a
    fresh process with its start-up heap frozen, as each relay runs: in the benchmark's own
    long-lived process the baseline lost a quarter to a half of its rate over a run (27,297 →
    14,601 msg/s, its CPU per record up a third) while the relays' rates held."""
    child = ("import gc, sys; from relay_bench import produce_here; gc.freeze(); "
             "print(produce_here(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], "
             "sys.argv[5] == 'memo'))")
    done = subprocess.run([sys.executable, "-c", child, bootstrap, topic, str(n), client,
                           "memo" if key_memo else "-"],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                          text=True, check=True)
    return float(done.stdout.split()[-1])


def produce_here(bootstrap: str, topic: str, n: int, client: str, key_memo: bool) -> float:
    """:func:`raw_produce` in this process."""
    records = [(b"key-%d" % (i % KEYS), [("outbox-id", str(i).encode()),
                                         ("content-type", b"application/octet-stream")])
               for i in range(n)]
    if client == "confluent":
        producer = Producer(librdkafka_config(RelaySettings(kafka_bootstrap=bootstrap)))
        acked = [0]

        def count(error: Any, _message: Any) -> None:
            assert error is None, error
            acked[0] += 1

        started = time.perf_counter()
        for key, headers in records:
            while True:
                try:
                    producer.produce(topic, PAYLOAD, key, headers=headers, on_delivery=count)
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        producer.flush()
        assert acked[0] == n
        return n / (time.perf_counter() - started)
    memo = {"partitioner": KeyHashPartitioner()} if key_memo else {}
    kafka = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER_DEFAULTS, **memo)
    started = time.perf_counter()
    futures = [kafka.send(topic, value=PAYLOAD, key=key, headers=headers)
               for key, headers in records]
    kafka.flush()
    for future in futures:
        future.get()
    elapsed = time.perf_counter() - started
    kafka.close()
    return n / elapsed


def bulk_publish(schema: str) -> TextClause:
    """:n committed prepare rows to :topic, keyed like publish does (one key, one shard), in
    one statement: with :status 'PENDING' each gets its pending row, with 'DELIVERED' its op
    record instead (history)."""
    return text(f"""
        WITH written AS (
            INSERT INTO {schema}.message (topic, key, payload, content_type, shard)
            SELECT :topic, convert_to('key-' || (i % {KEYS}), 'UTF8'), :payload,
                   'application/octet-stream', (i % {KEYS}) % {SHARDS}
            FROM generate_series(1, :n) AS i
            RETURNING id, topic, key, shard, created_at
        ), queued AS (
            INSERT INTO {schema}.pending
                (message_id, shard, topic, key, producer_group, status, resolution, created_at)
            SELECT id, shard, topic, key, 'default', 'PENDING', 'COMMIT', created_at
            FROM written WHERE :status = 'PENDING'
        )
        INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition,
                                        kafka_offset)
        SELECT id, 'DELIVERED', 'history', 0, id FROM written WHERE :status = 'DELIVERED'""")


def preload(engine: Engine, schema: str, topic: str, n: int, status: str = "PENDING") -> None:
    """``n`` rows of :func:`bulk_publish`, then ANALYZE."""
    with engine.begin() as conn:
        conn.execute(bulk_publish(schema),
                     {"topic": topic, "payload": PAYLOAD, "n": n, "status": status})
        for table in ("message", "pending", "op_record"):
            conn.execute(text(f"ANALYZE {schema}.{table}"))


def settle_database(engine: Engine, schema: str) -> None:
    """VACUUM and CHECKPOINT after a bulk load, so its background I/O is not measured."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("message", "pending", "op_record"):
            conn.execute(text(f"VACUUM ANALYZE {schema}.{table}"))
        conn.execute(text("CHECKPOINT"))


def drop_schema(engine: Engine, schema: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CHECKPOINT"))


def delivered(engine: Engine, schema: str, after: int = 0) -> int:
    """DELIVERED op records of messages after id ``after`` (those of a drain, not the
    history retained beside it): exact, but a count of the rows."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT count(*) FROM {schema}.op_record "
            f"WHERE action = 'DELIVERED' AND message_id > :after"), {"after": after}
        ).scalar_one())


def recorded(engine: Engine, schema: str) -> int:
    """Op records ever inserted: their id sequence, one row to read however many the table
    holds, which neither retention's drops nor its deletes take back (a rolled-back insert
    takes ids too: at most an upper bound of those committed)."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
            f"FROM {schema}.op_record_id_seq")).scalar_one())


def last_id(engine: Engine, schema: str) -> int:
    """The newest message id in ``schema`` (0 if none)."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT coalesce(max(id), 0) FROM {schema}.message")).scalar_one())


def start_relays(env: dict[str, str], schema: str, count: int, acks: Path | None = None
                 ) -> list[subprocess.Popen[bytes]]:
    """``count`` relay processes; with ``acks`` (a folder), each through ``ack_probe.py``,
    writing the moment of every Kafka acknowledgement to ``acks/relay-N.acks`` as it exits."""
    def command(n: int) -> list[str]:
        if acks is None:
            return [sys.executable, "-m", "outbox"]
        return [sys.executable, str(Path(__file__).with_name("ack_probe.py")),
                str(acks / f"relay-{n}.acks")]

    return [subprocess.Popen([*command(n), "--schema", schema, "relay", "--log-level",
                              "WARNING"], env=env,
                              preexec_fn=functools.partial(_ends_with_its_parent, os.getpid()))
            for n in range(count)]


_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _ends_with_its_parent(parent: int) -> None:
    """In the relay's process, before it runs: SIGTERM when the thread that started it ends.
    A benchmark stopped by a signal runs no ``finally``; the embedded services are reaped by
    the next start, but a relay would retry against a database that is gone until killed.
    (Every caller starts relays from its main thread.)"""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def migrate_as(env: dict[str, str], schema: str) -> None:
    """``schema`` migrated by the code ``env`` imports (an A/B's older side may stop at an
    earlier revision, and its relay refuses a schema newer than itself)."""
    subprocess.run([sys.executable, "-m", "outbox", "--schema", schema, "db", "upgrade"],
                   env=env, check=True, capture_output=True)


def running(relays: list[subprocess.Popen[bytes]]) -> None:
    """Raises if a relay has exited: the drain it was timing would never end."""
    for relay in relays:
        if relay.poll() is not None:
            raise SystemExit(f"a relay exited with status {relay.returncode} (its error is "
                             f"above)")


def stop(relays: list[subprocess.Popen[bytes]]) -> None:
    for relay in relays:
        relay.send_signal(signal.SIGTERM)
    for relay in relays:
        relay.wait(60)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far, every thread (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Drained:
    #: messages per second (see :func:`drain`)
    rate: float
    #: CPU seconds the relay processes used from the first delivery to the last
    cpu: float


def relay_throughput(services: devservices.Services, engine: Engine, env: dict[str, str],
                     relays: int, n: int, history: int = 0, client: str = "kafka-python",
                     tag: str = "") -> float:
    """Messages per second that ``relays`` relays deliver, draining ``n`` committed rows
    (:func:`drain`)."""
    return drain(services, engine, env, relays, n, history, client, tag).rate


def drain(services: devservices.Services, engine: Engine, env: dict[str, str], relays: int,
          n: int, history: int = 0, client: str = "kafka-python", tag: str = "") -> Drained:
    """``relays`` relays draining ``n`` committed rows (``tag`` keeps repeated runs in schemas
    and topics of their own). The rate counts from the first delivery to the last, or with
    several relays from the moment each has delivered (:func:`together`: one process
    starting later than another is not what a second relay adds)."""
    suffix = ("" if client == "kafka-python" else "_librdkafka") + (f"_{tag}" if tag else "")
    schema = f"bench_{relays}_{history}{suffix}"
    topic = f"bench-{relays}-{history}{suffix}".replace("_", "-")
    env = {**env, "OUTBOX_KAFKA_CLIENT": client}
    migrate_as(env, schema)
    create_topic(services.kafka_bootstrap, topic, partitions=6)
    if history:
        preload(engine, schema, topic, history, status="DELIVERED")
    after = last_id(engine, schema)  # the history's ids, not counted below
    preload(engine, schema, topic, n)
    settle_database(engine, schema)
    before = recorded(engine, schema)  # the history's op records
    processes = start_relays(env, schema, relays)
    try:
        # Progress is read from the op records' id sequence and counted exactly only at
        # both ends: counting the op records every 50 ms took the database 3-80 ms a time
        # (growing with the rows counted), and the drain ran 1.18x faster without it
        # (BENCHMARKS.md, "The drain's own measurement, session 28").
        # Time from the first delivery, so process start-up is not counted.
        while recorded(engine, schema) == before:
            running(processes)
            time.sleep(0.005)
        started, first = time.perf_counter(), delivered(engine, schema, after)
        cpu_before = sum(cpu_seconds(relay.pid) for relay in processes)
        while (done := delivered(engine, schema, after)) < n:
            while recorded(engine, schema) - before < n:
                running(processes)
                time.sleep(0.05)
            running(processes)
        rate = (done - first) / (time.perf_counter() - started)
        cpu = sum(cpu_seconds(relay.pid) for relay in processes) - cpu_before
    finally:
        stop(processes)
    if relays > 1:
        if (both := together(engine, schema, relays)) is None:
            say(f"   (the {relays} relays did not deliver side by side: the rate from the "
                "first delivery)")
        else:
            rate = both
    return Drained(rate, cpu)


def together(engine: Engine, schema: str, relays: int) -> float | None:
    """Messages per second recorded from the moment the last of ``relays`` relays recorded
    its first delivery to the last delivery (op records' times); None if some delivered
    nothing, or nothing was recorded after the last one's first delivery."""
    with engine.connect() as conn:
        row = conn.execute(text(f"""
            WITH firsts AS (SELECT actor, min(created_at) AS at FROM {schema}.op_record
                            WHERE action = 'DELIVERED' GROUP BY actor),
                 since AS (SELECT max(at) AS at, count(*) AS relays FROM firsts)
            SELECT since.relays, count(*) AS n,
                   extract(epoch FROM max(o.created_at) - since.at) AS seconds
            FROM {schema}.op_record AS o, since
            WHERE o.action = 'DELIVERED' AND o.created_at > since.at
            GROUP BY since.relays, since.at""")).one_or_none()
    return float(row.n / row.seconds) if row is not None and row.relays == relays else None


def batch_cost(services: devservices.Services, engine: Engine, history: int,
               batches: int = 20) -> tuple[float, float]:
    """Milliseconds to fetch, and to record, one batch of 500 next to ``history`` rows."""
    schema = f"bench_cost_{history}"
    migrate.upgrade(services.database_url, schema)
    if history:
        preload(engine, schema, "t", history, status="DELIVERED")
    preload(engine, schema, "t", batches * 500)
    settle_database(engine, schema)
    fetching = recording = 0.0
    with engine.connect() as conn:
        for _ in range(batches):
            started = time.perf_counter()
            with conn.begin():
                rows = store.fetch_deliverable(conn, schema, range(SHARDS), 500)
            fetched = time.perf_counter()
            with conn.begin():
                store.mark_delivered(conn, schema, "bench", [(r.id, 0, r.id) for r in rows])
            fetching += fetched - started
            recording += time.perf_counter() - fetched
    return fetching / batches * 1000, recording / batches * 1000


def latency_at_steady_rate(services: devservices.Services, engine: Engine,
                           env: dict[str, str], rate: int, seconds: float) -> tuple[float, ...]:
    schema, topic = "bench_latency", "bench-latency"
    migrate.upgrade(services.database_url, schema)
    create_topic(services.kafka_bootstrap, topic, partitions=6)
    processes = start_relays(env, schema, 1)
    outbox = Outbox(schema=schema)
    time.sleep(3)  # relay up and owning its shards
    try:
        interval = 1.0 / rate
        next_at = time.perf_counter()
        end = next_at + seconds
        i = 0
        with Session(engine) as session:
            while next_at < end:
                with session.begin():
                    outbox.publish(session, topic, PAYLOAD, key=f"key-{i % KEYS}")
                i += 1
                next_at += interval
                pause = next_at - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
        deadline = time.monotonic() + 30
        while delivered(engine, schema) < i and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop(processes)
    with engine.connect() as conn:
        latencies = [float(x) for x in conn.execute(text(f"""
            SELECT extract(epoch FROM o.created_at - m.created_at) * 1000
            FROM {schema}.op_record o JOIN {schema}.message m ON m.id = o.message_id
            WHERE o.action = 'DELIVERED'""")).scalars()]
    cuts = statistics.quantiles(latencies, n=100)
    return len(latencies) / seconds, cuts[49], cuts[98], max(latencies)


BUSINESS_TABLE = ("CREATE TABLE IF NOT EXISTS bench_orders "
                  "(id bigserial PRIMARY KEY, customer text, total numeric)")
#: The business transaction's own row, in every publish-cost benchmark.
BUSINESS = text("INSERT INTO bench_orders (customer, total) VALUES (:c, 10.5)")


@contextlib.contextmanager
def relay_asleep(database_url: str, schema: str) -> Iterator[None]:
    """A relay asleep on every shard for the block: each publishing commit NOTIFYs."""
    wakeup = Wakeup(database_url, schema)
    try:
        assert wakeup.fall_asleep(frozenset(range(SHARDS))) is not None
        yield
    finally:
        wakeup.close()


def publish_cost(services: devservices.Services, engine: Engine, seconds: float,
                 threads: int = 4) -> tuple[float, float, float, float]:
    """Business INSERT transactions per second from ``threads`` threads: alone, with a
    publish while relays are awake (no NOTIFY), with a publish while a relay sleeps, and
    with the business INSERT twice instead (what any one more statement costs them)."""
    schema = "bench_publish"
    migrate.upgrade(services.database_url, schema)
    with engine.begin() as conn:
        conn.execute(text(BUSINESS_TABLE))
    outbox = Outbox(schema=schema)

    def run(outbox: Outbox | None, inserts: int = 1) -> float:
        counts = [0] * threads
        stop_at = time.perf_counter() + seconds

        def worker(slot: int) -> None:
            with Session(engine) as session:
                while time.perf_counter() < stop_at:
                    with session.begin():
                        for _ in range(inserts):
                            session.execute(BUSINESS, {"c": f"c{slot}"})
                        if outbox is not None:
                            outbox.publish(session, "orders", {"customer": f"c{slot}"},
                                           key=f"c{slot}-{counts[slot] % 100}")
                    counts[slot] += 1

        workers = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(counts) / seconds

    bare = run(None)
    awake = run(outbox)
    with relay_asleep(services.database_url, schema):
        asleep = run(outbox)
    return bare, awake, asleep, run(None, inserts=2)


def sizes(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("""
            SELECT n.nspname || '.' || c.relname AS name,
                   pg_size_pretty(pg_relation_size(c.oid)) AS size, c.relkind
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname LIKE 'bench_%' AND c.relkind IN ('r', 'i')
              AND c.relname IN ('message', 'op_record', 'message_pkey', 'message_relay_idx',
                                'op_record_pkey')
              AND pg_relation_size(c.oid) > 0
            ORDER BY n.nspname, c.relkind DESC, c.relname""")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--publish-seconds", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="OUTBOX_RELAY_BATCH_SIZE for the relays (default: theirs)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2,3,4")
    parser.add_argument("--clients", default="kafka-python,confluent",
                        help="the relay's Kafka clients to measure in part 1")
    args = parser.parse_args()
    skip = set(args.skip.split(","))

    say("starting embedded PostgreSQL (durable: fsync on) and Kafka broker ...")
    services = devservices.start(durable=True)
    env = {**os.environ, **services.env()}
    if args.batch_size:
        env["OUTBOX_RELAY_BATCH_SIZE"] = str(args.batch_size)
    engine = create_engine(sqlalchemy_url(services.database_url), pool_size=8)
    try:
        say(f"\n1. throughput, {args.messages:,} messages of 1 KiB, 1000 keys")
        create_topic(services.kafka_bootstrap, "bench-raw", partitions=6)
        raw = raw_produce(services.kafka_bootstrap, "bench-raw", args.messages)
        say(f"   raw kafka-python produce (no database): {raw:10,.0f} msg/s  1.00x")
        clients = args.clients.split(",")
        if "confluent" in clients:
            create_topic(services.kafka_bootstrap, "bench-raw-librdkafka", partitions=6)
            fast = raw_produce(services.kafka_bootstrap, "bench-raw-librdkafka", args.messages,
                               "confluent")
            say(f"   raw librdkafka produce (no database):   {fast:10,.0f} msg/s  "
                f"{fast / raw:.2f}x raw")
        for relays in () if "1" in skip else (1, 2):
            for client in clients:
                rate = relay_throughput(services, engine, env, relays, args.messages,
                                        client=client)
                say(f"   outbox relay x{relays}, {client + ' client:':22} {rate:10,.0f} msg/s  "
                    f"{rate / raw:.2f}x raw")
        if args.history and "2" not in skip:
            say(f"\n2. bounded cost: {args.history:,} delivered rows (and op records) retained")
            empty = batch_cost(services, engine, 0)
            full = batch_cost(services, engine, args.history)
            say(f"   fetch one batch of 500:  {empty[0]:6.2f} ms empty, {full[0]:6.2f} ms with "
                f"history  {full[0] / empty[0]:.2f}x")
            say(f"   record one batch of 500: {empty[1]:6.2f} ms empty, {full[1]:6.2f} ms with "
                f"history  {full[1] / empty[1]:.2f}x")
            rate = relay_throughput(services, engine, env, 1, args.messages, args.history)
            say(f"   outbox relay x1 over history:          {rate:10,.0f} msg/s  "
                f"{rate / raw:.2f}x raw")
            say("   sizes with the history:")
            for row in sizes(engine):
                say(f"     {'table' if row.relkind == 'r' else 'index'} {row.name:45} {row.size}")
            for schema in (f"bench_cost_{args.history}", f"bench_1_{args.history}"):
                drop_schema(engine, schema)
        if "3" not in skip:
            say("\n3. latency commit -> broker ack at a steady 1,000 msg/s, 1 relay "
                "(fresh services: the runs above leave vacuum work behind)")
            fresh = devservices.start(durable=True)
            fresh_engine = create_engine(sqlalchemy_url(fresh.database_url))
            try:
                achieved, p50, p99, worst = latency_at_steady_rate(
                    fresh, fresh_engine, {**env, **fresh.env()}, 1000, args.latency_seconds)
            finally:
                fresh_engine.dispose()
                devservices.stop(fresh)
            say(f"   achieved {achieved:,.0f} msg/s: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                f"max {worst:.1f} ms")
        if "4" not in skip:
            say("\n4. cost of publish in a business transaction (4 client threads)")
            bare, awake, asleep, twice = publish_cost(services, engine, args.publish_seconds)
            say(f"   business insert alone:               {bare:8,.0f} TPS  1.00x")
            say(f"   + publish, relays awake (no NOTIFY): {awake:8,.0f} TPS  {awake / bare:.2f}x")
            say(f"   + publish, a relay asleep (NOTIFY):  {asleep:8,.0f} TPS  "
                f"{asleep / bare:.2f}x")
            say(f"   the insert twice, no publish:        {twice:8,.0f} TPS  {twice / bare:.2f}x")
        say("\n5. table and index sizes after the runs (history schemas dropped)")
        for row in sizes(engine):
            say(f"   {'table' if row.relkind == 'r' else 'index'} {row.name:45} {row.size}")
    finally:
        engine.dispose()
        devservices.stop(services)


if __name__ == "__main__":
    main()
