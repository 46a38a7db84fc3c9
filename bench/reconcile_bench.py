"""Reconciliation throughput on local Spark against the embedded services.

    python bench/reconcile_bench.py [--messages 5000000] [--master local[2]]
        [--kafka-client both] [--update BENCHMARKS.md]

Generates delivered messages and their op records with generate_series, produces the
matching Kafka records (key, outbox-id header, the offsets the op records name) with
kafka-python from one process per partition, then times `spark.reconcile.run` over the whole
window: tables only, and with the topic read by each ``--kafka-client`` (``--repeat`` times
each, alternating). Reports messages per second of each run (the SparkSession start is
reported apart) with where its time went (the run summary's seconds_by_phase), checks every
run comes out CLEAN, and with ``--update`` writes the table into that file (bench/report.py).

``--after-tables-only`` times instead the first topic run after a tables-only run judged the
whole window: every record it reads is of a window it did not judge, checked against its
message's op records (reconcile._outside), and reports the driver's peak memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import resource
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from report import Figure, markdown_table, replace_block, text_table
from sqlalchemy import Engine, create_engine, text

from outbox import migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.settings import Settings, sqlalchemy_url
from outbox.spark import reconcile as job
from outbox.spark.kafka_source import high_watermarks
from outbox.spark.runs import RunOutcome

TOPIC = "bench"
SCHEMA = "outbox"


def say(line: str) -> None:
    print(line, flush=True)


def generate_tables(engine: Engine, n: int, partitions: int, keys: int) -> None:
    """n delivered messages, created 1 ms apart, each with its DELIVERED op record.

    Message g has key k<g % keys>, partition g % partitions (keys % partitions == 0, so a key
    stays in one partition) and offset (g - 1) // partitions: the id order within a key.
    """
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {SCHEMA}.message (id, topic, key, payload, content_type, shard, "
            f"created_at) "
            f"SELECT g, :topic, convert_to('k' || (g % :keys), 'UTF8'), "
            f"'\\x7b7d'::bytea, 'application/json', g % 64, "
            f"now() - interval '3 hours' + g * interval '1 millisecond' "
            f"FROM generate_series(1, :n) AS g"),
            {"topic": TOPIC, "keys": keys, "n": n})
        conn.execute(text(
            f"INSERT INTO {SCHEMA}.op_record (id, message_id, action, actor, kafka_partition, "
            f"kafka_offset, created_at) "
            f"SELECT g, g, 'DELIVERED', 'bench', g % :partitions, (g - 1) / :partitions, "
            f"now() - interval '3 hours' + g * interval '1 millisecond' "
            f"+ (g % 50) * interval '1 millisecond' "
            f"FROM generate_series(1, :n) AS g"), {"partitions": partitions, "n": n})
        for table in ("message", "op_record"):
            conn.execute(text(
                f"SELECT setval(pg_get_serial_sequence('{SCHEMA}.{table}', 'id'), :n)"),
                {"n": n})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {SCHEMA}.message, {SCHEMA}.op_record"))


def produce_partition(bootstrap: str, partition: int, partitions: int, n: int, keys: int
                      ) -> None:
    """The records of one partition, in id order (so offsets match the op records)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20,
                             batch_size=1024 * 1024, enable_idempotence=True,
                             max_in_flight_requests_per_connection=5)
    first = partition if partition else partitions
    for g in range(first, n + 1, partitions):
        producer.send(TOPIC, value=b"{}", key=b"k%d" % (g % keys), partition=partition,
                      headers=[("outbox-id", b"%d" % g),
                               ("content-type", b"application/json")])
    producer.flush()
    producer.close()


def produce_records(bootstrap: str, n: int, partitions: int, keys: int) -> None:
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=produce_partition,
                               args=(bootstrap, p, partitions, n, keys))
               for p in range(partitions)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise SystemExit(f"producer exited with {worker.exitcode}")
    ends = high_watermarks(bootstrap, [TOPIC])
    expected = {(TOPIC, p): len(range(p or partitions, n + 1, partitions))
                for p in range(partitions)}
    if ends != expected:
        raise SystemExit(f"topic holds {ends}, expected {expected}")


def timed_run(spark: Any, settings: Settings, since: datetime | None = datetime(
        2000, 1, 1, tzinfo=UTC)) -> dict[str, Any]:
    started = time.perf_counter()
    result = job.run(spark, settings, since=since, until=datetime.now(UTC))
    seconds = time.perf_counter() - started
    messages = result.summary["counts"]["messages"] or result.summary["counts"]["kafka_records"]
    if result.outcome is not RunOutcome.CLEAN:
        raise SystemExit(f"expected a clean run:\n{result.report}")
    return {"seconds": round(seconds, 1), "messages": messages,
            "kafka_records": result.summary["counts"]["kafka_records"],
            "messages_per_second": round(messages / seconds),
            "seconds_by_phase": result.summary["seconds_by_phase"]}


#: The issue 15 targets, in messages per second, per kind of run.
TARGETS = {"tables_only": 200_000, "with_topic": 80_000}


def figures(results: dict[str, Any]) -> list[Figure]:
    """The best run of each kind against its target (the first run pays the JVM warm-up)."""
    out = []
    for kind, runs in results.items():
        if not isinstance(runs, list):
            continue
        best = max(runs, key=lambda r: r["messages_per_second"])
        target = TARGETS["tables_only" if kind == "tables_only" else "with_topic"]
        phases = ", ".join(f"{name} {seconds:.1f}s"
                           for name, seconds in best["seconds_by_phase"].items())
        out.append(Figure(f"{kind.replace('_', ' ')} ({phases})", best["messages_per_second"],
                          "msg/s", target, "target", (">=", 1.0)))
    return out


def timed_kinds(spark: Any, settings: Settings, args: argparse.Namespace,
                results: dict[str, Any]) -> None:
    """Each kind of run over the whole window, ``--repeat`` times, alternating."""
    kinds = [("tables_only", settings)]
    clients = (["kafka-python", "confluent"] if args.kafka_client == "both"
               else [args.kafka_client])
    if not args.skip_topic:
        kinds += [(f"with_topic_{client.replace('-', '_')}", settings.model_copy(
            update={"reconcile_read_topics": True, "kafka_client": client}))
            for client in clients]
    for _ in range(args.repeat):
        for kind, kind_settings in kinds:
            results.setdefault(kind, []).append(timed_run(spark, kind_settings))
            say(f"{kind}: {results[kind][-1]}")


def after_tables_only(spark: Any, settings: Settings, client: str, results: dict[str, Any]
                      ) -> None:
    """A tables-only run judges every message, then a topic run reads every record as of a
    window it did not judge (its own window holds none)."""
    results["tables_only_first"] = timed_run(spark, settings, since=None)
    say(f"tables only: {results['tables_only_first']}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results["topic_run_after"] = timed_run(spark, settings.model_copy(update={
        "reconcile_read_topics": True,
        "kafka_client": "kafka-python" if client == "both" else client}), since=None)
    results["driver_peak_rss_mb"] = {
        "before": round(before / 1024), "after": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    say(f"topic run after it: {results['topic_run_after']}; the driver's peak RSS "
        f"{results['driver_peak_rss_mb']} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5_000_000)
    parser.add_argument("--partitions", type=int, default=4, help="topic partitions")
    parser.add_argument("--keys", type=int, default=10_000, help="a multiple of --partitions")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--jdbc-partitions", type=int, default=8)
    parser.add_argument("--skip-topic", action="store_true", help="time tables only")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each kind in one session (the first pays the JIT warm-up)")
    parser.add_argument("--kafka-client", choices=["kafka-python", "confluent", "both"],
                        default="both", help="the topic reader(s) to time")
    parser.add_argument("--after-tables-only", action="store_true",
                        help="time the first topic run after a tables-only run of the window")
    parser.add_argument("--results", type=Path, default=Path("bench/results/reconcile.json"))
    parser.add_argument("--update", type=Path, help="write the table into this Markdown file")
    args = parser.parse_args()
    if args.keys % args.partitions:
        parser.error("--keys must be a multiple of --partitions")
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)

    services = devservices.start()
    output = tempfile.mkdtemp(prefix="reconcile-bench-")
    try:
        migrate.upgrade(services.database_url, SCHEMA)
        create_topic(services.kafka_bootstrap, TOPIC, partitions=args.partitions)
        engine = create_engine(sqlalchemy_url(services.database_url))
        started = time.perf_counter()
        generate_tables(engine, args.messages, args.partitions, args.keys)
        say(f"generated {args.messages:,} messages and op records in "
            f"{time.perf_counter() - started:.0f}s")
        results: dict[str, Any] = {"messages": args.messages, "master": args.master,
                                   "topic_partitions": args.partitions}
        if not args.skip_topic:
            started = time.perf_counter()
            produce_records(services.kafka_bootstrap, args.messages, args.partitions, args.keys)
            say(f"produced {args.messages:,} Kafka records in "
                f"{time.perf_counter() - started:.0f}s")
        settings = Settings(
            database_url=services.database_url, kafka_bootstrap=services.kafka_bootstrap,
            schema_name=SCHEMA, reconcile_output_dir=output, reconcile_spark_master=args.master,
            reconcile_partitions=args.jdbc_partitions)
        started = time.perf_counter()
        spark = job.local_session(settings)
        results["session_start_seconds"] = round(time.perf_counter() - started, 1)
        try:
            if args.after_tables_only:
                after_tables_only(spark, settings, args.kafka_client, results)
            else:
                timed_kinds(spark, settings, args, results)
        finally:
            spark.stop()
        engine.dispose()
    finally:
        devservices.stop(services)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    say(json.dumps(results, indent=2))
    if args.after_tables_only:
        return  # no targets for it: its figures are in the JSON above
    table = figures(results)
    say(text_table(table))
    if args.update:
        block = (f"{args.messages:,} messages, {args.master}, best of {args.repeat} per kind; "
                 f"phases in seconds:\n\n{markdown_table(table)}")
        args.update.write_text(replace_block(
            args.update.read_text(), block, name="reconcile bench",
            title="Spark reconciliation: the issue 15 targets"))


if __name__ == "__main__":
    main()
