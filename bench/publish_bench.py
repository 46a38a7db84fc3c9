"""Where publish's cost goes: per statement, and with each writer in its own process.

    python bench/publish_bench.py [--seconds 6] [--writers 4 16] [--ranges 30]

1. One connection, one transaction of 3,000 statements each: the wall time of a bare
   single-row INSERT next to a publish (``publish_message()``: advisory key lock, message and
   pending rows, the wake-up), then again with ``--ranges`` partitions of ``message``.
2. ``--writers`` processes (no shared GIL, unlike `make bench`'s threads) each running
   business INSERT (+ publish) transactions with durable commits for ``--seconds``: TPS
   alone, with publish while relays are awake (no NOTIFY) and while a relay sleeps (every
   commit NOTIFYs), and the WAL each transaction wrote;
3. the same transactions from pgbench, whose C clients cost the machine next to nothing, so
   the database is the bound (as behind many application servers): what NOTIFY costs there;
4. pgbench again while one relay delivers the messages: the wake-up as built against every
   commit notifying (a ``pg_notify`` after each publish).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from relay_bench import BUSINESS, BUSINESS_TABLE, relay_asleep, start_relays, stop
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, store
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.encoding import encode
from outbox.settings import sqlalchemy_url

SCHEMA = "bench_publish_cost"
ORDER = {"customer": "c"}  # the published payload


MODES = {"bare": "business INSERT alone", "awake": "+ publish, relays awake",
         "asleep": "+ publish, a relay asleep"}


def writer(url: str, mode: str, seconds: float, slot: int,
           done: multiprocessing.Queue[int]) -> None:
    engine = create_engine(url, pool_size=1)
    outbox = None if mode == "bare" else Outbox(schema=SCHEMA)
    count, stop_at = 0, time.perf_counter() + seconds
    with Session(engine) as session:
        while time.perf_counter() < stop_at:
            with session.begin():
                session.execute(BUSINESS, {"c": f"c{slot}"})
                if outbox is not None:
                    outbox.publish(session, "orders", {"customer": f"c{slot}"},
                                   key=f"c{slot}-{count % 100}")
            count += 1
    engine.dispose()
    done.put(count)


def partition_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = CAST(:t AS regclass)"),
            {"t": f"{SCHEMA}.message"}).scalar_one())


def per_statement(url: str) -> None:
    engine = create_engine(url)
    outbox = Outbox(schema=SCHEMA)

    def timed(label: str, statement: Callable[[Session, int], object]) -> None:
        with Session(engine) as session, session.begin():
            started = time.perf_counter()
            for i in range(3000):
                statement(session, i)
            elapsed = time.perf_counter() - started
        print(f"   {label:34} {elapsed / 3000 * 1e6:6.0f} µs per statement", flush=True)

    def bare(session: Session, _i: int) -> object:
        return session.execute(BUSINESS, {"c": "c"})

    def publish(session: Session, i: int) -> object:
        return outbox.publish(session, "orders", {"customer": "c"}, key=f"c-{i % 100}")

    for _ in range(2):
        timed("bare INSERT", bare)
        timed("publish", publish)
    engine.dispose()


def processes(url: str, database_url: str, writers: int, seconds: float) -> None:
    engine = create_engine(url)
    rates: dict[str, float] = {}
    for mode, label in MODES.items():
        with engine.connect() as conn:
            before = conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one()
        done: multiprocessing.Queue[int] = multiprocessing.Queue()
        workers = [multiprocessing.Process(target=writer, args=(url, mode, seconds, s, done))
                   for s in range(writers)]
        with asleep_if(mode, database_url):
            for process in workers:
                process.start()
            total = sum(done.get() for _ in workers)
            for process in workers:
                process.join()
        with engine.connect() as conn:
            wal = conn.execute(text("SELECT pg_current_wal_lsn() - CAST(:lsn AS pg_lsn)"),
                               {"lsn": before}).scalar_one()
        rates[mode] = total / seconds
        ratio = rates[mode] / rates["bare"]
        print(f"   {label:26} {rates[mode]:7,.0f} TPS  {ratio:.2f}x   "
              f"WAL {float(wal) / total:5.0f} B/transaction", flush=True)
    engine.dispose()


def asleep_if(mode: str, database_url: str) -> contextlib.AbstractContextManager[None]:
    return relay_asleep(database_url, SCHEMA) if mode == "asleep" else contextlib.nullcontext()


def pgbench_script(schema: str, publish: bool, notify_always: bool = False,
                   inserts: int = 1, keys: int = 100_000, by_client: bool = False) -> str:
    """The business INSERT transaction for pgbench, with the publish statement's own text
    when ``publish``: its varying parameters become pgbench variables, NULLs are written in,
    the rest are set once with -D (:func:`pgbench_defines`). ``notify_always``: every commit
    notifies, as before relays slept on shards (the comparison's baseline). ``inserts``: the
    business INSERT that many times (2: the cost of any one more row, the floor a publish
    that writes a row can reach; 0: the publish alone). ``keys``: how many keys the messages
    are spread over. ``by_client``: each message's producer group is its pgbench client's id
    (soak.py matches messages with pgbench's log of commits by it)."""
    statements = [BUSINESS.text.replace(":c", "'c'")] * inserts
    if publish:
        sql = "\n".join(line for line in store.query("publish", schema).text.splitlines()
                        if not line.lstrip().startswith("--")).rstrip(";")
        swapped = {"key": ":n", "lock_key": ":n", "header_keys": "NULL", "header_values": "NULL",
                   "deliver_at": "NULL", "check_after_seconds": "NULL"}  # the statement casts
        if by_client:
            swapped["producer_group"] = ":client_id"
        sql = re.sub(r"(?<!:):(\w+)", lambda m: swapped.get(m[1], m[0]), sql)
        statements.append(sql)
        if notify_always:
            statements.append("SELECT pg_notify(:channel, '')")
    return (f"\\set n random(1, {keys})\n\\set shard random(0, 63)\nBEGIN;\n"
            + "".join(f"{statement};\n" for statement in statements) + "COMMIT;\n")


def pgbench_defines(schema: str, topic: str = "orders",
                    payload: object = ORDER) -> list[str]:
    message = encode(topic, payload, key="k", headers=None, content_type=None,
                     max_payload_bytes=1 << 20, random_shard=0)
    _, params = store.publish(schema, message)
    fixed = {name: value for name, value in params.items()
             if name not in ("key", "lock_key", "shard") and value is not None}
    text_of = {bytes: lambda v: "\\x" + v.hex(), bool: lambda v: str(v).lower()}
    return [f"-D{name}={text_of.get(type(value), str)(value)}" for name, value in fixed.items()]


def pgbench_publish(services: devservices.Services, clients: int, seconds: float,
                    schema: str = SCHEMA) -> tuple[float, float, float, float]:
    """TPS of pgbench's ``clients``: business INSERT alone, with a publish while relays are
    awake, with a publish while a relay sleeps, and with a second business INSERT instead
    of a publish (durable commits)."""
    migrate.upgrade(services.database_url, schema)
    engine = create_engine(sqlalchemy_url(services.database_url))
    with engine.begin() as conn:
        conn.execute(text(BUSINESS_TABLE))
    engine.dispose()
    rates = []
    for mode in MODES:
        with asleep_if(mode, services.database_url):
            rates.append(pgbench_tps(services, clients, seconds,
                                     pgbench_script(schema, publish=mode != "bare"), schema))
    rates.append(pgbench_tps(services, clients, seconds,
                             pgbench_script(schema, publish=False, inserts=2), schema))
    return rates[0], rates[1], rates[2], rates[3]


def run_pgbench(services: devservices.Services, folder: Path, script: str,
                options: list[str], defines: list[str]) -> str:
    """pgbench's output for ``script`` (written into ``folder``, where its logs go too),
    prepared statements, no vacuum first, with ``options`` (clients, threads, duration) and
    the ``defines`` of :func:`pgbench_defines`."""
    path = folder / "transaction.sql"
    path.write_text(script)
    command = [os.path.join(services.pg_bindir, "pgbench"), "-n", "-M", "prepared", *options,
               "-f", str(path), *defines, services.database_url]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def pgbench_tps(services: devservices.Services, clients: int, seconds: float, script: str,
                schema: str) -> float:
    with tempfile.TemporaryDirectory() as folder:
        output = run_pgbench(services, Path(folder), script,
                             ["-c", str(clients), "-j", str(min(clients, 2)),
                              "-T", f"{seconds:g}"], pgbench_defines(schema))
    found = re.search(r"^tps = ([\d.]+)", output, re.M)
    assert found is not None, output
    return float(found[1])


def beside_a_relay(services: devservices.Services, clients: int, seconds: float,
                   rounds: int = 2, schema: str = "bench_publish_relay") -> None:
    """pgbench's ``clients`` publishing while one relay (librdkafka) delivers their messages:
    as built, then with every commit notifying (before relays slept on shards), alternated."""
    migrate.upgrade(services.database_url, schema)
    engine = create_engine(sqlalchemy_url(services.database_url))
    with engine.begin() as conn:
        conn.execute(text(BUSINESS_TABLE))
    create_topic(services.kafka_bootstrap, "orders", partitions=3)
    env = {**os.environ, **services.env(), "OUTBOX_KAFKA_CLIENT": "confluent"}
    relays = start_relays(env, schema, 1)
    try:
        time.sleep(5)  # up, shards owned
        for _ in range(rounds):
            built = pgbench_tps(services, clients, seconds,
                                pgbench_script(schema, publish=True), schema)
            always = pgbench_tps(services, clients, seconds,
                                 pgbench_script(schema, publish=True, notify_always=True), schema)
            with engine.connect() as conn:
                backlog = conn.execute(text(f"SELECT count(*) FROM {schema}.pending")).scalar_one()
            print(f"   as built {built:7,.0f} TPS, every commit notifying {always:7,.0f} TPS: "
                  f"{built / always:.2f}x (undelivered after: {backlog})", flush=True)
    finally:
        stop(relays)
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--writers", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--ranges", type=int, default=30,
                        help="step 1 again after making ranges of 100,000 ids this many "
                             "ahead of the id sequence (the count printed is what exists)")
    args = parser.parse_args()
    print("starting embedded PostgreSQL (durable: fsync on) and Kafka broker ...", flush=True)
    services = devservices.start(durable=True)
    os.environ.update(services.env())
    url = sqlalchemy_url(services.database_url)
    try:
        migrate.upgrade(services.database_url, SCHEMA)
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(BUSINESS_TABLE))
        for ranges in (None, args.ranges):
            if ranges is not None:
                with engine.begin() as conn:
                    store.ensure_partitions(conn, SCHEMA, 100_000, ahead=ranges)
            print(f"1. one connection, 3,000 statements in one transaction "
                  f"({partition_count(engine)} partitions of message)", flush=True)
            per_statement(url)
        engine.dispose()
        for writers in args.writers:
            print(f"2. {writers} writer processes, {args.seconds:g} s each, durable commits",
                  flush=True)
            processes(url, services.database_url, writers, args.seconds)
        for writers in args.writers:
            print(f"3. pgbench, {writers} clients, {args.seconds:g} s each, durable commits",
                  flush=True)
            rates = pgbench_publish(services, writers, args.seconds)
            labels = [*MODES.values(), "a 2nd INSERT, no publish"]
            for label, rate in zip(labels, rates, strict=True):
                print(f"   {label:26} {rate:7,.0f} TPS  {rate / rates[0]:.2f}x", flush=True)
        for writers in args.writers:
            print(f"4. pgbench, {writers} clients, {args.seconds:g} s each, beside a relay "
                  "delivering", flush=True)
            beside_a_relay(services, writers, args.seconds)
    finally:
        devservices.stop(services)


if __name__ == "__main__":
    main()
