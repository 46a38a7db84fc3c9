"""`make bench`: the issue 10 figures in one run, one table of ratios, written to BENCHMARKS.md.

    python bench/run_all.py [--quick] [--messages 50000] [--publish-seconds 5] [--no-write]

On fresh embedded services (durable: fsync on), in this order:

1. WAL written per delivered message: --wal-messages committed 1 KiB rows drained by one
   relay, pg_current_wal_lsn() before and after the drain (first, so no other schema's
   vacuum work is in the window); once within one checkpoint cycle (steady load), once
   right after a CHECKPOINT (every page's first change logs a full-page image);
2. business insert + publish vs business insert alone, at 4 and at 16 concurrent writers
   (Python threads), while relays are awake (no NOTIFY) and while one sleeps (every commit
   NOTIFYs), and the business insert twice (what any one more statement costs them); then
   the same transactions from pgbench, whose C clients leave the database as the bound
   (publish_bench.pgbench_publish), and there the business insert twice too: what any one
   more row costs the transaction, the floor for a publish that writes one;
3. raw kafka-python produce (in a fresh process, as each relay runs; with kafka-python's own
   partitioner, and again with the relay's memo of key hashes), then one relay with
   the kafka-python and with the confluent transport draining --messages committed rows, then
   two relays with each (relay_bench's functions); --rounds times,
   interleaved, medians reported (the raw baseline alone moved between 21k and 30k msg/s from
   run to run on the 2-core VM);
4. one relay draining --messages rows beside --history delivered rows still retained (the
   fetch must not read them: a plan that did cost 0.4 s a batch at 300,000).

The long figures (latency per minute over ten minutes, retention under load) are
`make soak` (bench/soak.py).

Prints one table (figure, value, baseline, ratio, target, met) and replaces the table between
the markers in BENCHMARKS.md with it, with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import textwrap
import time
from pathlib import Path

from publish_bench import pgbench_publish
from relay_bench import (
    delivered,
    preload,
    publish_cost,
    raw_produce,
    relay_throughput,
    running,
    say,
    settle_database,
    start_relays,
    stop,
)
from report import Figure, markdown_table, replace_block, round_ratios, text_table
from sqlalchemy import Engine, create_engine, text

from outbox import migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.settings import sqlalchemy_url

ROOT = Path(__file__).resolve().parents[1]


def wal_snapshot(engine: Engine) -> tuple[str, int]:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT pg_current_wal_lsn()::text, wal_fpi FROM pg_stat_wal"))
        lsn, fpi = row.one()
    return str(lsn), int(fpi)


def wal_per_delivery(services: devservices.Services, engine: Engine, env: dict[str, str],
                     n: int, checkpoint: bool) -> tuple[float, float]:
    """WAL bytes and full-page images per message over one relay's drain of ``n`` rows.

    Without ``checkpoint`` the rows are written and delivered within one checkpoint cycle, as
    under steady load (publish and delivery milliseconds apart); with it, the drain starts
    right after a CHECKPOINT, so the first change to every page logs a full-page image.
    """
    schema, topic = f"bench_wal_{int(checkpoint)}", f"bench-wal-{int(checkpoint)}"
    migrate.upgrade(services.database_url, schema)
    create_topic(services.kafka_bootstrap, topic, partitions=6)
    preload(engine, schema, topic, n)
    if checkpoint:
        settle_database(engine, schema)
    else:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"VACUUM ANALYZE {schema}.message"))
    before, fpi_before = wal_snapshot(engine)
    processes = start_relays(env, schema, 1)
    try:
        while delivered(engine, schema) < n:
            running(processes)
            time.sleep(0.05)
    finally:
        stop(processes)
    after, fpi_after = wal_snapshot(engine)
    with engine.connect() as conn:
        written = int(conn.execute(text("SELECT pg_wal_lsn_diff(:a, :b)"),
                                   {"a": after, "b": before}).scalar_one())
    return written / n, (fpi_after - fpi_before) / n


def throughput_rounds(services: devservices.Services, engine: Engine, env: dict[str, str],
                      messages: int, rounds: int) -> dict[str, list[float]]:
    """Each throughput figure ``rounds`` times, interleaved: raw produce, then the relays."""
    runs: dict[str, list[float]] = {"raw": [], "raw, key memo": [], "kafka-python": [],
                                    "confluent": [], "2 relays, kafka-python": [],
                                    "2 relays, confluent": []}
    for round_ in range(1, rounds + 1):
        topic = f"bench-raw-{round_}"
        create_topic(services.kafka_bootstrap, topic, partitions=6)
        runs["raw"].append(raw_produce(services.kafka_bootstrap, topic, messages))
        create_topic(services.kafka_bootstrap, f"{topic}-memo", partitions=6)
        runs["raw, key memo"].append(raw_produce(services.kafka_bootstrap, f"{topic}-memo",
                                                 messages, key_memo=True))
        for relays, client in itertools.product((1, 2), ("kafka-python", "confluent")):
            runs[client if relays == 1 else f"2 relays, {client}"].append(relay_throughput(
                services, engine, env, relays, messages, client=client, tag=f"r{round_}"))
        say(f"   round {round_}: " + ", ".join(f"{name} {values[-1]:,.0f}"
                                                for name, values in runs.items()) + " msg/s")
    return runs


def of(rounds: int) -> str:
    return f" (median of {rounds})" if rounds > 1 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (20,000 messages, 2 s per publish run)")
    parser.add_argument("--messages", type=int, default=None,
                        help="messages per throughput run (default 50,000)")
    parser.add_argument("--wal-messages", type=int, default=None,
                        help="messages in the WAL drain (default 20,000)")
    parser.add_argument("--publish-seconds", type=float, default=None,
                        help="seconds per publish-cost run (default 5)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="throughput runs per figure, median reported (default 3)")
    parser.add_argument("--history", type=int, default=None,
                        help="delivered rows beside the last drain (default 500,000)")
    parser.add_argument("--file", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    messages = args.messages or (20_000 if args.quick else 50_000)
    wal_messages = args.wal_messages or (10_000 if args.quick else 20_000)
    seconds = args.publish_seconds or (2.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 3)
    history = args.history or (100_000 if args.quick else 500_000)

    started = time.monotonic()
    load = os.getloadavg()
    say("starting fresh embedded PostgreSQL (durable: fsync on) and Kafka broker ...")
    services = devservices.start(durable=True)
    env = {**os.environ, **services.env()}
    engine = create_engine(sqlalchemy_url(services.database_url), pool_size=20)
    figures: list[Figure] = []
    try:
        say(f"1. WAL per delivered message, {wal_messages:,} messages drained by 1 relay")
        wal, fpi = wal_per_delivery(services, engine, env, wal_messages, checkpoint=False)
        say(f"   {wal:,.0f} B/message ({fpi:.2f} full-page images/message)")
        worst, worst_fpi = wal_per_delivery(services, engine, env, wal_messages, checkpoint=True)
        say(f"   right after a CHECKPOINT: {worst:,.0f} B/message ({worst_fpi:.2f} full-page "
            "images/message)")
        figures.append(Figure("WAL written per delivered message (1 relay drain)", wal, "B",
                              target=("<=", 400)))
        figures.append(Figure("... the drain right after a CHECKPOINT (full-page images)",
                              worst, "B"))

        for writers in (4, 16):
            say(f"2. business insert + publish vs insert alone, {writers} writers, {seconds:g} s "
                "each")
            bare, awake, asleep, twice = publish_cost(services, engine, seconds,
                                                      threads=writers)
            say(f"   alone {bare:,.0f} TPS, + publish {awake:,.0f} (relays awake), "
                f"{asleep:,.0f} (a relay asleep: every commit NOTIFYs), "
                f"+ a 2nd business INSERT {twice:,.0f}")
            for label, tps in (("relays awake", awake), ("a relay asleep", asleep)):
                figures.append(Figure(f"business insert + publish, {writers} writers, {label}",
                                      tps, "TPS", bare, "insert alone", (">=", 0.8)))
            figures.append(Figure(f"business insert twice, no publish, {writers} writers "
                                  "(any one more statement)", twice, "TPS", bare,
                                  "insert alone"))
            say(f"   the same from pgbench (C clients: the database is the bound), {seconds:g} s "
                "each")
            bare, awake, asleep, second = pgbench_publish(services, writers, seconds)
            say(f"   alone {bare:,.0f} TPS, + publish {awake:,.0f} (relays awake), "
                f"{asleep:,.0f} (a relay asleep), + a 2nd business INSERT {second:,.0f}")
            for label, tps in (("relays awake", awake), ("a relay asleep", asleep)):
                figures.append(Figure(f"pgbench: insert + publish, {writers} writers, {label}",
                                      tps, "TPS", bare, "insert alone", (">=", 0.8)))
            figures.append(Figure(f"pgbench: the insert twice, no publish, {writers} writers "
                                  "(any one more row)", second, "TPS", bare, "insert alone"))

        say(f"3. relay throughput, {messages:,} messages of 1 KiB, median of {rounds} rounds "
            "(raw, relays, raw, relays, ...: the machine's drift hits baseline and relay alike)")
        runs = throughput_rounds(services, engine, env, messages, rounds)
        raw = statistics.median(runs["raw"])
        relay_figures = [Figure(f"raw kafka-python produce, no database{of(rounds)}", raw,
                                "msg/s"),
                         Figure(f"... with the relay's key-hash memo{of(rounds)}",
                                statistics.median(runs["raw, key memo"]), "msg/s", raw,
                                "raw kafka-python")]
        for client, target in (("kafka-python", 0.9), ("confluent", 1.5)):
            relay_figures.append(Figure(f"1 relay, {client} transport{of(rounds)}",
                                        statistics.median(runs[client]), "msg/s", raw,
                                        "raw kafka-python", (">=", target)))
        # With kafka-python one relay is bound by its interpreter, not by the database or
        # the cores: a second process adds a second one. With librdkafka one relay leaves
        # about a quarter of a core idle (BENCHMARKS.md, "Scale-out, session 26").
        for client in ("kafka-python", "confluent"):
            relay_figures.append(Figure(f"2 relays, {client} transport{of(rounds)}",
                                        statistics.median(runs[f"2 relays, {client}"]), "msg/s",
                                        statistics.median(runs[client]), f"1 relay, {client}",
                                        (">=", 1.3)))
        say(f"4. 1 relay (kafka-python) draining {messages:,} messages beside {history:,} "
            "delivered ones still retained")
        deep = relay_throughput(services, engine, env, 1, messages, history=history)
        say(f"   {deep:,.0f} msg/s")
        relay_figures.append(Figure(f"1 relay, kafka-python, beside {history:,} retained "
                                    "deliveries", deep, "msg/s",
                                    statistics.median(runs["kafka-python"]),
                                    "1 relay, kafka-python, no history"))
        figures = relay_figures + figures
        by_round = round_ratios(runs, [("kafka-python", "raw"), ("confluent", "raw"),
                                       ("2 relays, kafka-python", "kafka-python"),
                                       ("2 relays, confluent", "confluent")])
        say(f"   {by_round}")
    finally:
        engine.dispose()
        devservices.stop(services)

    elapsed = time.monotonic() - started
    say("\n" + text_table(figures))
    met = sum(1 for f in figures if f.met)
    judged = sum(1 for f in figures if f.met is not None)
    say(f"\n{met} of {judged} targets met; {elapsed:.0f} s")
    if args.no_write:
        return
    command = "make bench" + (" BENCH_ARGS=--quick" if args.quick else "")
    block = "\n".join([
        textwrap.fill(
            f"`{command}` ({messages:,} messages per throughput run, {wal_messages:,} in the WAL "
            f"drain, {seconds:g} s per publish run; {elapsed:.0f} s in all). Run of "
            f"{datetime.date.today().isoformat()} on {platform.node() or 'this machine'}: "
            f"nproc {os.cpu_count()}, load average {load[0]:.1f} at the start. Fresh durable "
            "embedded PostgreSQL and Tansu; every ratio against a baseline measured in the same "
            f"run. WAL drains: {fpi:.2f} full-page images per message when rows are published and "
            f"delivered within one checkpoint cycle (the target row), {worst_fpi:.2f} when the "
            "drain starts right after a CHECKPOINT.", width=95),
        "",
        markdown_table(figures),
        "",
        textwrap.fill(by_round, width=95),
        "",
        f"{met} of {judged} targets met.",
    ])
    args.file.write_text(replace_block(args.file.read_text(), block))
    say(f"updated {args.file}")


if __name__ == "__main__":
    main()
