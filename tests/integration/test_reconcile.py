"""Spark reconciliation (issue 5) on real Spark, PostgreSQL and Kafka, locally and on a
standalone cluster (issue 15).

Clean data comes from the real flow (publish, two-phase, the relay); defects are injected
afterwards with SQL and by producing stray records, each on messages of its own, so every
test below fails for one reason.
"""

from __future__ import annotations

import gc
import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from kafka import KafkaProducer
from py4j.protocol import Py4JJavaError
from pyspark.errors import PythonException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Outbox, migrate
from outbox.cli import main
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic, read_topic
from outbox.settings import Settings
from outbox.spark import carry, queries, sources
from outbox.spark import reconcile as job
from outbox.spark.kafka_source import KafkaRangeReader, high_watermarks
from outbox.spark.runs import RunOutcome
from tests import spark_cluster
from tests.conftest import TRANSPORTS, publish_orders, running_relay, wait_delivered, wait_until
from tests.integration.test_retention import age, deliver, prune

INTEGRITY = {
    "undelivered_after_sla", "delivered_although_rolled_back", "op_record_without_message",
    "kafka_record_without_op_record", "op_record_position_mismatch", "key_order_broken",
}


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = job.local_session(Settings(reconcile_spark_master="local[2]"))
    yield session
    session.stop()


def reconcile_settings(services: devservices.Services, schema: str, output: Path) -> Settings:
    return Settings(
        database_url=services.database_url, kafka_bootstrap=services.kafka_bootstrap,
        schema_name=schema, relay_poll_interval=0.3, relay_lease_seconds=3,
        reconcile_read_topics=True, reconcile_output_dir=str(output),
        reconcile_sla_seconds=60, reconcile_partitions=2,
    )


def scenario_settings(services: devservices.Services, output: Path) -> tuple[Settings, str]:
    """A schema of its own, migrated, and a topic of 3 partitions, for a module's shared
    scenario: its settings and the topic."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    topic = f"orders-{uuid.uuid4().hex[:10]}"
    migrate.upgrade(services.database_url, schema)
    create_topic(services.kafka_bootstrap, topic, partitions=3)
    return reconcile_settings(services, schema, output), topic


def found(spark: SparkSession, result: job.Result) -> dict[str, set[int | None]]:
    """Message ids per finding, read back from the run's Parquet files."""
    ids: dict[str, set[int | None]] = {}
    for row in spark.read.parquet(str(result.output_path / "findings")).collect():
        ids.setdefault(row.finding, set()).add(row.message_id)
    return ids


def publish_clean_flow(engine: Engine, outbox: Outbox, topic: str, n: int) -> list[int]:
    keys = [f"customer-{i % 6}" for i in range(n)]
    return publish_orders(engine, outbox, topic, [(key, i) for i, key in enumerate(keys)])


def run_between(spark: SparkSession, engine: Engine, settings: Settings, topic: str,
                before: int, after: int) -> job.Result:
    """``before`` messages delivered, a run, then ``after`` more delivered; the run's result."""
    outbox, schema = Outbox(settings=settings), settings.schema_name
    with running_relay(settings):
        publish_clean_flow(engine, outbox, topic, before)
        wait_delivered(engine, schema, before)
        first = job.run(spark, settings, until=datetime.now(UTC))
        publish_clean_flow(engine, outbox, topic, after)
        wait_delivered(engine, schema, before + after)
    return first


def insert_message(conn: object, schema: str, topic: str, **columns: object) -> int:
    """A message row written as the publish statement writes it, then moved to ``status``
    and aged by ``age`` (as the relay, the sweeper and time would)."""
    values = {"key": None, "resolution": "COMMIT", "status": "PENDING", "check_count": 0,
              "age": "0 seconds", **columns}
    execute = conn.execute  # type: ignore[attr-defined]
    message_id = int(execute(text(
        f"WITH m AS (INSERT INTO {schema}.message (topic, key, payload, content_type, shard) "
        f"VALUES (:topic, :key, CAST('{{}}' AS bytea), 'application/json', 0) "
        f"RETURNING id, topic, key, created_at), "
        f"p AS (INSERT INTO {schema}.pending (message_id, shard, topic, key, producer_group, "
        f"status, resolution, created_at, next_check_at) "
        f"SELECT id, 0, topic, key, 'default', 'PENDING', :resolution, created_at, "
        f"now() + interval '30 seconds' FROM m) "
        f"SELECT id FROM m"),
        {"topic": topic, "key": values["key"], "resolution": values["resolution"]}
    ).scalar_one())
    for table, column in (("message", "id"), ("pending", "message_id")):
        execute(text(f"UPDATE {schema}.{table} SET created_at = created_at - "
                     f"CAST(:age AS interval) WHERE {column} = :id"),
                {"age": values["age"], "id": message_id})
    if values["status"] in ("DELIVERED", "ROLLED_BACK"):
        execute(text(f"DELETE FROM {schema}.pending WHERE message_id = :id"), {"id": message_id})
    else:
        execute(text(f"UPDATE {schema}.pending SET status = :status, check_count = :checks "
                     f"WHERE message_id = :id"),
                {"status": values["status"], "checks": values["check_count"], "id": message_id})
    return message_id


def produce(bootstrap: str, topic: str, partition: int, key: bytes | None,
            message_id: int | None) -> int:
    """Send one record as a stray or a copy would arrive; returns its offset."""
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        headers = [] if message_id is None else [("outbox-id", str(message_id).encode())]
        return int(producer.send(topic, b"{}", key=key, partition=partition,
                                 headers=headers).get(timeout=30).offset)
    finally:
        producer.close()


# --- clean data --------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_flow_reconciles_clean(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    settings = reconcile_settings(services, schema, tmp_path)
    outbox = Outbox(settings=settings)
    with running_relay(settings):
        publish_clean_flow(engine, outbox, topic, 30)
        publish_orders(engine, outbox, topic, [("customer-1", 99)], commit=False)
        with Session(engine) as session, session.begin():
            outbox.publish(session, topic, {"later": True}, key="delayed",
                           deliver_after=timedelta(hours=1))
        with Session(engine) as session, session.begin():
            committed = outbox.prepare(session, topic, {"two-phase": 1}, key="tp-commit")
            rolled_back = outbox.prepare(session, topic, {"two-phase": 2}, key="tp-rollback")
        outbox.commit(engine, committed)
        outbox.rollback(engine, rolled_back)
        wait_delivered(engine, schema, 31)

    result = job.run(spark, settings, until=datetime.now(UTC))

    assert result.counts == dict.fromkeys(result.counts, 0)
    assert result.outcome is RunOutcome.CLEAN and result.exit_code == 0
    assert result.summary["counts"] == {"messages": 33, "op_records": 32, "kafka_records": 31,
                                        "carried_in": 0, "carried_out": 1}  # the delayed one
    by_state = {(c["resolution"], c["status"]): c["count"]
                for c in result.summary["stats"]["counts"]}
    assert by_state == {("COMMIT", "DELIVERED"): 31, ("COMMIT", "DELAYED"): 1,
                        ("ROLLBACK", "ROLLED_BACK"): 1}
    overall = next(lat for lat in result.summary["stats"]["latency_seconds"]
                   if lat["topic"] == "*")
    assert overall["delivered"] == 31 and 0 <= overall["p50"] <= overall["max"]


# --- defects -----------------------------------------------------------------------------------


@dataclass
class Defects:
    """The ids of the messages each defect was injected on."""

    settings: Settings
    topic: str
    undelivered: int = 0
    duplicated: int = 0
    rolled_back_but_delivered: int = 0
    orphan_op_for: int = 555_555_555
    stray_id: int = 987_654_321
    misplaced_op: int = 0
    order_swapped: int = 0
    stuck: int = 0
    discarded: int = 0
    clean: set[int] = field(default_factory=set)


@pytest.fixture(scope="module")
def defects(services: devservices.Services, engine: Engine,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Defects]:
    settings, topic = scenario_settings(services, tmp_path_factory.mktemp("reconcile"))
    schema = settings.schema_name
    d = Defects(settings, topic)
    with running_relay(settings):
        d.clean = set(publish_clean_flow(engine, Outbox(settings=settings), topic, 60))
        wait_delivered(engine, schema, 60)
    bootstrap = services.kafka_bootstrap
    positions = {r.message_id: r for r in read_topic(bootstrap, topic)}
    last_of_key = {positions[i].key: i for i in sorted(d.clean)}
    # Misplaced op record: X, the last message of its key, claims the last offset of its
    # partition, held by another key (six keys in three partitions: some partition has two).
    shared = next(p for p in range(3)
                  if len({r.key for r in positions.values() if r.partition == p}) > 1)
    last = max((r for r in positions.values() if r.partition == shared), key=lambda r: r.offset)
    x = next(i for i in last_of_key.values()
             if positions[i].partition == shared and positions[i].key != last.key)
    d.misplaced_op = x
    d.duplicated, d.rolled_back_but_delivered = sorted(d.clean - {x, last.message_id})[:2]

    with engine.begin() as conn:
        d.undelivered = insert_message(conn, schema, topic, key=b"never-sent", age="1 hour")
        d.stuck = insert_message(conn, schema, topic, resolution="UNKNOWN", check_count=7,
                                 age="1 hour")
        d.discarded = insert_message(conn, schema, topic, resolution="UNKNOWN",
                                     status="DISCARDED", check_count=15, age="1 hour")
        conn.execute(text(
            f"INSERT INTO {schema}.op_record (message_id, action, actor, detail) "
            f"VALUES (:id, 'DISCARDED', 'sweeper', 'no answer after 15 checks')"),
            {"id": d.discarded})
        conn.execute(text(  # an impossible history: delivered, and rolled back as well
            f"INSERT INTO {schema}.op_record (message_id, action, actor) "
            f"VALUES (:id, 'ROLLED_BACK', 'forger')"), {"id": d.rolled_back_but_delivered})
        conn.execute(text(
            f"UPDATE {schema}.op_record SET kafka_offset = :offset WHERE message_id = :id"),
            {"offset": last.offset, "id": x})
        conn.execute(text(
            f"INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, "
            f"kafka_offset) VALUES (:id, 'DELIVERED', 'ghost', 0, 0)"), {"id": d.orphan_op_for})
        # Two messages of one key, delivered in the wrong order, each with a correct op record.
        first = insert_message(conn, schema, topic, key=b"swapped", status="DELIVERED")
        second = insert_message(conn, schema, topic, key=b"swapped", status="DELIVERED")
        d.order_swapped = second
        for message_id in (second, first):
            offset = produce(bootstrap, topic, 0, b"swapped", message_id)
            conn.execute(text(
                f"INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, "
                f"kafka_offset) VALUES (:id, 'DELIVERED', 'relay', 0, :offset)"),
                {"id": message_id, "offset": offset})
        # Two messages of one key, the first parked, resumed by an operator and so delivered
        # after the second: the order guarantees.md documents, not a broken one.
        parked = insert_message(conn, schema, topic, key=b"resumed", status="DELIVERED")
        later = insert_message(conn, schema, topic, key=b"resumed", status="DELIVERED")
        d.clean |= {parked, later}
        for message_id, actions in ((later, ["DELIVERED"]),
                                    (parked, ["PARKED", "RESUMED", "DELIVERED"])):
            offset = produce(bootstrap, topic, 1, b"resumed", message_id)
            for action in actions:
                at = (1, offset) if action == "DELIVERED" else (None, None)
                conn.execute(text(
                    f"INSERT INTO {schema}.op_record (message_id, action, actor, "
                    f"kafka_partition, kafka_offset) VALUES (:id, :action, 'relay', "
                    f":partition, :offset)"),
                    {"id": message_id, "action": action, "partition": at[0], "offset": at[1]})
    copy = positions[d.duplicated]
    produce(bootstrap, topic, copy.partition, copy.key, d.duplicated)
    produce(bootstrap, topic, 1, b"stray", d.stray_id)
    produce(bootstrap, topic, 2, None, None)
    produce(bootstrap, topic, 2, b"foreign", 10**20)  # another producer's header, over a bigint
    yield d
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))


@pytest.fixture(scope="module")
def defect_run(spark: SparkSession, defects: Defects) -> job.Result:
    return job.run(spark, defects.settings, until=datetime.now(UTC))


@pytest.fixture(scope="module")
def defect_findings(spark: SparkSession, defect_run: job.Result) -> dict[str, set[int | None]]:
    return found(spark, defect_run)


def test_committed_message_not_delivered_within_the_sla_is_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["undelivered_after_sla"] == {defects.undelivered}


def test_duplicate_delivery_is_reported_with_its_copies(
    defects: Defects, defect_run: job.Result, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["delivered_more_than_once"] == {defects.duplicated}
    duplicates = next(f for f in defect_run.summary["findings"]
                      if f["name"] == "delivered_more_than_once")
    assert duplicates["count"] == 1 and not duplicates["exceeded"]


def test_delivered_message_that_was_rolled_back_is_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["delivered_although_rolled_back"] == {
        defects.rolled_back_but_delivered}


def test_op_record_without_prepare_row_is_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["op_record_without_message"] == {defects.orphan_op_for}


def test_kafka_records_without_op_record_are_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    """The foreign header's value too large for a bigint ended every run with a traceback
    (and each next run read the same record)."""
    assert defect_findings["kafka_record_without_op_record"] == {defects.stray_id, None}


def test_op_record_pointing_at_another_record_is_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["op_record_position_mismatch"] == {defects.misplaced_op}


def test_broken_per_key_order_in_kafka_is_found(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["key_order_broken"] == {defects.order_swapped}


def test_rows_stuck_unknown_are_reported_with_their_check_counts(
    spark: SparkSession, defects: Defects, defect_run: job.Result
) -> None:
    rows = spark.read.parquet(str(defect_run.output_path / "findings")).where(
        "finding = 'stuck_unknown'").collect()
    assert [(r.message_id, r.detail.split(",")[0]) for r in rows] == [
        (defects.stuck, "7 check-backs")]


def test_discarded_rows_are_reported(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    assert defect_findings["discarded"] == {defects.discarded}


def test_clean_messages_among_the_defects_are_not_reported(
    defects: Defects, defect_findings: dict[str, set[int | None]]
) -> None:
    named = set().union(*defect_findings.values())
    untouched = defects.clean - {defects.duplicated, defects.rolled_back_but_delivered,
                                 defects.misplaced_op}
    assert not named & untouched


def test_integrity_findings_fail_the_run_and_report_only_ones_do_not(
    defect_run: job.Result
) -> None:
    assert defect_run.outcome is RunOutcome.FAILED and defect_run.exit_code == 1
    assert set(defect_run.exceeded) == INTEGRITY


def test_run_records_its_summary_and_writes_its_report(
    engine: Engine, defects: Defects, defect_run: job.Result
) -> None:
    with engine.connect() as conn:
        row = conn.execute(text(
            f"SELECT outcome, messages, findings, output_path, kafka_offsets "
            f"FROM {defects.settings.schema_name}.reconcile_run WHERE id = :id"),
            {"id": defect_run.run_id}).one()
    assert row.outcome == "FAILED"
    assert row.findings == defect_run.counts
    assert row.output_path == str(defect_run.output_path)
    assert sum(sum(p.values()) for p in row.kafka_offsets.values()) == 60 + 8  # 8 by hand
    report = (defect_run.output_path / "report.txt").read_text()
    assert "FAIL  undelivered_after_sla" in report and f"ids: {defects.undelivered}" in report
    assert json.loads((defect_run.output_path / "summary.json").read_text())["run_id"] == (
        defect_run.run_id)


def test_tables_only_run_finds_what_the_tables_show(
    spark: SparkSession, defects: Defects, defect_run: job.Result
) -> None:
    settings = defects.settings.model_copy(update={"reconcile_read_topics": False})
    result = job.run(spark, settings, since=datetime(2000, 1, 1, tzinfo=UTC),
                     until=defect_run.window.until)

    ids = found(spark, result)
    assert "op_record_position_mismatch" not in result.counts
    assert "kafka_record_without_op_record" not in result.counts
    assert ids["undelivered_after_sla"] == {defects.undelivered}
    assert ids["delivered_although_rolled_back"] == {defects.rolled_back_but_delivered}
    assert ids["key_order_broken"] == {defects.order_swapped}
    assert "delivered_more_than_once" not in ids


def test_both_kafka_clients_read_the_same_records(
    spark: SparkSession, defects: Defects
) -> None:
    """kafka-python and confluent-kafka, each from offset 0 in pieces of 7 records (so most
    pieces start mid-partition), stray records without an outbox-id included."""
    bootstrap = defects.settings.kafka_bootstrap
    plan = sources.plan_topics(high_watermarks(bootstrap, [defects.topic]), {}, None, True)
    read = {
        client: sorted(tuple(r) for r in sources.read_topics(
            spark, bootstrap, plan, library=client, max_records_per_split=7).collect())
        for client in TRANSPORTS
    }
    assert len(read["kafka-python"]) == 60 + 8  # delivered, and produced by hand
    assert read["confluent"] == read["kafka-python"]


@pytest.mark.parametrize("client", TRANSPORTS)
def test_the_reader_pauses_the_garbage_collector_only_while_it_reads(
    defects: Defects, client: str
) -> None:
    """Off while records stream (its collections took half the read's time), on again after
    the last batch, and when Spark stops reading a range early."""
    bootstrap = defects.settings.kafka_bootstrap
    plan = sources.plan_topics(high_watermarks(bootstrap, [defects.topic]), {}, None, True)
    piece = next(r for r in plan.ranges if r.end > r.start)
    reader = KafkaRangeReader(bootstrap, plan.ranges, stall_seconds=30, library=client)
    assert gc.isenabled()
    batches = reader.read(piece)
    next(batches)
    assert not gc.isenabled()
    batches.close()
    assert gc.isenabled()
    assert sum(batch.num_rows for batch in reader.read(piece)) == piece.end - piece.start
    assert gc.isenabled()


def test_a_run_finds_the_same_with_either_kafka_client(
    spark: SparkSession, defects: Defects, defect_run: job.Result
) -> None:
    found_with = {}
    for client in TRANSPORTS:
        settings = defects.settings.model_copy(update={"kafka_client": client})
        found_with[client] = found(spark, job.run(
            spark, settings, since=datetime(2000, 1, 1, tzinfo=UTC),
            until=defect_run.window.until))
    assert found_with["confluent"] == found_with["kafka-python"]
    assert found_with["confluent"]["op_record_position_mismatch"] == {defects.misplaced_op}
    assert found_with["confluent"]["key_order_broken"] == {defects.order_swapped}


# --- on a Spark cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[spark_cluster.Cluster]:
    with spark_cluster.standalone(tmp_path_factory.mktemp("spark-cluster")) as started:
        yield started


@pytest.mark.slow
def test_spark_submit_to_a_standalone_cluster_finds_what_the_local_run_finds(
    spark: SparkSession, engine: Engine, defects: Defects, defect_run: job.Result,
    cluster: spark_cluster.Cluster, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Issue 15: ``spark-submit --master spark://...`` with the job's code shipped as a zip
    and executors whose Python lacks this package (tests/spark_cluster.py); its findings must
    equal the local run's on the same data (this module's ``defect_run``, shared with the
    tests above)."""
    settings = defects.settings
    package = spark_cluster.package(tmp_path_factory.mktemp("package"))
    node_python = spark_cluster.node_python(tmp_path_factory.mktemp("node"))
    with engine.begin() as conn:  # the cluster run starts from where the local run did
        conn.execute(text(f"DELETE FROM {settings.schema_name}.reconcile_run"))

    submitted = spark_cluster.spark_submit(
        cluster, package, node_python,
        {"OUTBOX_DATABASE_URL": settings.database_url, "OUTBOX_SCHEMA": settings.schema_name,
         "OUTBOX_KAFKA_BOOTSTRAP": settings.kafka_bootstrap}, tmp_path,
        "--read-topics", "--until", defect_run.window.until.isoformat(),
        "--sla-seconds", str(settings.reconcile_sla_seconds),
        "--partitions", str(settings.reconcile_partitions), "--output-dir", str(tmp_path / "out"))

    assert submitted.returncode == defect_run.exit_code == 1, submitted.stderr[-5000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {part: summary["window"][part] for part in ("since", "until", "source")} == {
        part: defect_run.summary["window"][part] for part in ("since", "until", "source")}
    assert summary["counts"] == defect_run.summary["counts"]
    assert summary["findings"] == defect_run.summary["findings"]
    assert spark_cluster.findings_by_name(spark, run_dir) == spark_cluster.findings_by_name(
        spark, defect_run.output_path)
    wait_until(lambda: len(cluster.status()["completedapps"]) == 1, 30, "the app to complete")
    (app,) = cluster.status()["completedapps"]
    assert app["name"] == "outbox-reconcile" and app["cores"] == 1


# --- incremental runs and the command line -----------------------------------------------------


def test_next_run_covers_only_what_is_new_since_the_last(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    settings = reconcile_settings(services, schema, tmp_path)
    first = run_between(spark, engine, settings, topic, 12, 5)

    second = job.run(spark, settings, until=datetime.now(UTC))

    assert first.summary["counts"] == {"messages": 12, "op_records": 12, "kafka_records": 12,
                                       "carried_in": 0, "carried_out": 0}
    assert second.summary["counts"] == {"messages": 5, "op_records": 5, "kafka_records": 5,
                                        "carried_in": 0, "carried_out": 0}
    assert second.window.since == first.window.until
    assert second.outcome is RunOutcome.CLEAN


def test_a_copy_of_an_earlier_windows_message_is_found_by_the_next_run(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A message judged by one run is copied to Kafka again afterwards (a takeover's re-send
    landing late, a producer outside the relay): the next run reads the copy as new, and
    its message is in no window of its own. It was ignored, and the duplicate never
    reported; its recorded copy, read again by no run, is not."""
    settings = reconcile_settings(services, schema, tmp_path)
    with running_relay(settings):
        ids = publish_clean_flow(engine, Outbox(settings=settings), topic, 6)
        wait_delivered(engine, schema, 6)
    first = job.run(spark, settings, until=datetime.now(UTC))
    assert first.outcome is RunOutcome.CLEAN
    copied = ids[2]
    offset = produce(settings.kafka_bootstrap, topic, 1, b"customer-2", copied)

    second = job.run(spark, settings, until=datetime.now(UTC))

    assert second.summary["counts"]["messages"] == 0
    duplicates = [row for row in spark.read.parquet(
        str(second.output_path / "findings")).collect()]
    assert [(r.finding, r.message_id, r.partition, r.offset) for r in duplicates] == [
        ("delivered_more_than_once", copied, 1, offset)], duplicates
    assert "after its window was judged" in duplicates[0].detail


def test_a_topic_whose_offsets_start_again_is_read_from_its_start(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last run stopped reading further on than the topic now ends (deleted and
    recreated, or records lost; here the recorded watermark is moved on by 1,000). The next
    run read nothing of it as new, so a stray record there was missed and the watermark fell
    back silently; and its keys' last positions, handed on by the last run, were of the old
    log (key_order_broken for the keys' next messages)."""
    settings = reconcile_settings(services, schema, tmp_path)
    first = run_between(spark, engine, settings, topic, 6, 2)  # keys the first run handed on
    assert first.outcome is RunOutcome.CLEAN
    with engine.begin() as conn:
        conn.execute(text(
            f"UPDATE {schema}.reconcile_run SET kafka_offsets = jsonb_build_object("
            f"'{topic}', (SELECT jsonb_object_agg(p, (o::text)::bigint + 1000) FROM "
            f"jsonb_each(kafka_offsets -> '{topic}') AS e(p, o)))"))
    keys = str(first.output_path / "carry" / "keys")
    old_log = spark.read.parquet(keys).select(
        "topic", "key", "id", *[(F.col(c) + 1000).alias(c) for c in ("op_at", "copy_at")])
    spark.createDataFrame(old_log.collect(), carry.KEYS_SCHEMA).write.mode(
        "overwrite").parquet(keys)
    stray = produce(settings.kafka_bootstrap, topic, 0, b"customer-1", None)

    with caplog.at_level("WARNING", logger="outbox.reconcile"):
        second = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, second) == {"kafka_record_without_op_record": {None}}, stray
    assert second.summary["counts"]["kafka_records"] == 8 + 1
    assert f"topic {topic} partition 0 ends at offset" in caplog.text
    assert "read from its start" in caplog.text


def test_messages_delivered_while_the_run_reads_are_not_copies_without_op_records(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables are read first, the topics after. A message pending when the tables were
    read and delivered before the topics were (a delayed message falling due, a backlog
    draining) was in Kafka without an op record in what the run saw: reported as
    kafka_record_without_op_record, an integrity finding, and the run FAILED."""
    settings = reconcile_settings(services, schema, tmp_path)
    ids = publish_clean_flow(engine, Outbox(settings=settings), topic, 4)
    read_topics = job._read_topics

    def delivered_first(*args: object, **kwargs: object) -> object:
        with running_relay(settings):  # between the reads, as a relay would
            wait_delivered(engine, schema, len(ids))
        return read_topics(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(job, "_read_topics", delivered_first)
    result = job.run(spark, settings, until=datetime.now(UTC))

    assert result.summary["counts"]["kafka_records"] == len(ids)
    assert not result.counts["kafka_record_without_op_record"], found(spark, result)
    assert result.outcome is RunOutcome.CLEAN


def test_records_of_messages_retention_dropped_are_not_strays(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, small: Settings
) -> None:
    """A first run reads the topics from their start: every record of a message whose range
    retention had dropped named no prepare row, and was reported as a stray
    (kafka_record_without_op_record, an integrity finding): reconciliation added to an outbox
    older than its retention failed at once. Ids below the lowest range kept are pruned."""
    settings = reconcile_settings(services, schema, tmp_path).model_copy(
        update={"partition_size": small.partition_size})
    deliver(engine, Outbox(settings=settings), settings, topic, 25)
    age(engine, schema)
    assert "dropped 2 partitions" in prune(settings)  # ids 1-20
    stray = produce(settings.kafka_bootstrap, topic, 0, b"stray", 987_654_321)

    result = job.run(spark, settings, until=datetime.now(UTC))

    assert result.summary["counts"]["kafka_records"] == 25 + 1
    assert found(spark, result).get("kafka_record_without_op_record") == {987_654_321}, stray


def test_a_window_given_by_hand_lies_in_the_past(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    tmp_path: Path
) -> None:
    """A run's end is where the next starts: `--until` a day ahead recorded a run ending
    then, and every run after it found "nothing new" until that day. `--since` after the last
    run's end left the time between to no run: CLEAN, and those messages never looked at."""
    settings = reconcile_settings(services, schema, tmp_path).model_copy(
        update={"reconcile_read_topics": False})
    now = datetime.now(UTC)
    ahead, hour_ago = now + timedelta(days=1), now - timedelta(hours=1)
    for since, until, error in ((None, ahead, "--until .* is after the database's clock"),
                                (ahead, None, "--since .* is after the database's clock"),
                                (hour_ago, hour_ago, "--since .* is not before --until")):
        with pytest.raises(ConfigurationError, match=error):
            job.run(spark, settings, since=since, until=until)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.reconcile_run")).scalar() == 0
    last = job.run(spark, settings).window.until
    assert last <= datetime.now(UTC)
    time.sleep(1.5)  # a --since after the last run's end, and in the past
    with pytest.raises(ConfigurationError, match=r"--since .* is after the last run's end"):
        job.run(spark, settings, since=last + timedelta(seconds=1))
    assert job.run(spark, settings, since=last).window.since == last


def test_a_job_that_fails_as_it_runs_says_one_line_and_exits_4(
    spark: SparkSession, services: devservices.Services, schema: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor that lost Kafka (or a JDBC read that failed) printed 400 lines of Python
    and Java tracebacks and exited 1, as a run that found too much does: a cron job could
    not tell an outage from findings. The error here is Spark's own, raised by an executor."""
    def lose_kafka(_: int) -> int:
        raise ConnectionError("Kafka at 127.0.0.1:9 went away")

    with pytest.raises(PythonException) as failed:
        spark.range(1).select(F.udf(lose_kafka)("id")).collect()
    assert job.job_failure(failed.value) == "ConnectionError: Kafka at 127.0.0.1:9 went away"
    assert job.job_failure(ValueError("a bug")) is None, "a bug keeps its traceback"
    lost = psycopg.OperationalError("consuming input failed: server closed the connection "
                                    "unexpectedly")
    assert job.job_failure(lost) == ("OperationalError: consuming input failed: server closed "
                                     "the connection unexpectedly"), "it exited 2"
    assert job.job_failure(psycopg.errors.UniqueViolation("duplicate key")) is None
    with pytest.raises(Py4JJavaError) as java:  # a Java error's line is its innermost cause's
        spark.sparkContext._jvm.java.lang.Class.forName("no.such.Kind")  # type: ignore[union-attr]
    assert job.job_failure(java.value) == "java.lang.ClassNotFoundException: no.such.Kind"

    def run(*_: object, **__: object) -> job.Result:
        raise failed.value

    monkeypatch.setattr(job, "run", run)
    env = {"OUTBOX_DATABASE_URL": services.database_url, "OUTBOX_SCHEMA": schema,
           "OUTBOX_RECONCILE_OUTPUT_DIR": str(tmp_path)}
    handlers = [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)]
    result = CliRunner().invoke(main, ["reconcile", "--tables-only"], env=env)

    assert result.exit_code == 4, result.output
    assert [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)] == handlers, \
        "the command's signal handlers outlived it"
    assert result.output.strip().splitlines() == [
        "outbox: error: the reconciliation job failed as it ran (nothing was recorded; the "
        "next run reads the same window): ConnectionError: Kafka at 127.0.0.1:9 went away"]


def test_command_exits_1_over_a_threshold_and_0_when_that_finding_only_reports(
    spark: SparkSession, defects: Defects, defect_run: job.Result, tmp_path: Path
) -> None:
    """In-process, on the shared session: the command leaves a session it did not start."""
    env = {"OUTBOX_DATABASE_URL": defects.settings.database_url,
           "OUTBOX_SCHEMA": defects.settings.schema_name,
           "OUTBOX_RECONCILE_OUTPUT_DIR": str(tmp_path)}
    window = ["--since", "2000-01-01T00:00:00", "--until", defect_run.window.until.isoformat(),
              "--tables-only", "--sla-seconds", "60"]
    reporting_only = [f"--threshold={name}=none" for name in INTEGRITY]

    failing = CliRunner().invoke(main, ["reconcile", *window], env=env)
    passing = CliRunner().invoke(main, ["reconcile", *window, *reporting_only], env=env)

    assert failing.exit_code == 1, failing.output
    assert "FAIL  undelivered_after_sla" in failing.output
    assert passing.exit_code == 0, passing.output
    assert "note  undelivered_after_sla" in passing.output


def test_the_orphan_check_reads_the_window_s_id_ranges_rather_than_every_message(
    engine: Engine, schema: str
) -> None:
    """Its cost must follow the window's op records, not the message history: hashing every
    message id (the planner's choice for a large window) grows with the table. Each range
    reads message ids within its bounds only; the op records of messages outside the window's
    ids probe the primary key one by one."""
    n = 200_000
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {schema}.message (id, topic, key, payload, content_type, shard) "
            f"SELECT g, 't', NULL, '\\x7b7d'::bytea, 'application/json', 0 "
            f"FROM generate_series(1, :n) AS g"), {"n": n})
        conn.execute(text(
            f"INSERT INTO {schema}.op_record (id, message_id, action, actor) "
            f"SELECT g, g, 'DELIVERED', 'test' FROM generate_series(1, :n) AS g"), {"n": n})
    ids = (1, n // 8)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {schema}.message, {schema}.op_record"))
        window = queries.Window(None, datetime.now(UTC) + timedelta(hours=1))

        def plan(subquery: str) -> list[str]:
            return [row[0] for row in conn.execute(text("EXPLAIN SELECT * FROM " + subquery))]

        ranged = plan(queries.orphan_op_records(schema, window, ids))
        outlying = plan(queries.outlying_orphan_op_records(schema, window, ids, (ids[1] + 1, n)))

    # message is partitioned by id: the rows are in message_p1, the other partitions are empty
    scans = [i for i, line in enumerate(ranged) if " on message_" in line]
    assert scans, ranged
    for i in scans:
        condition = next(line for line in ranged[i + 1:] if "Index Cond" in line)
        assert f"(id >= {ids[0]})" in condition and f"(id <= {ids[1]})" in condition, ranged
    assert any("using message_p1_pkey on message_p1 " in line for line in outlying), outlying
    assert not any("Hash" in line for line in outlying), outlying


def test_a_run_sets_aside_the_timeouts_a_dba_set_on_its_role(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A JDBC read takes as long as its rows, and between two fetches its session is idle in
    its transaction while Spark works: a role's ``statement_timeout`` cancelled the reads and
    its ``idle_in_transaction_session_timeout`` ended them. The run lock's connection is idle
    while the run works: ``idle_session_timeout`` ended it, the lock with it (a second run
    could start), and the run failed at its end."""
    login = f"{schema}_timed"
    timeouts = {"statement_timeout": "5s", "idle_in_transaction_session_timeout": "5s",
                "lock_timeout": "5s", "idle_session_timeout": "1s"}
    # the server's side of the TCP timeout (30 s), which pgjdbc cannot set on its socket
    server_tcp = {"tcp_keepalives_idle": "15", "tcp_keepalives_interval": "5",
                  "tcp_keepalives_count": "3", "tcp_user_timeout": "30000"}
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' "
                          f"IN ROLE {devservices.DB_USER}, pg_read_all_stats"))
        for name, value in timeouts.items():
            conn.execute(text(f"ALTER ROLE {login} SET {name} = '{value}'"))
    url = services.database_url.replace(
        f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
    settings = reconcile_settings(services, schema, tmp_path).model_copy(
        update={"database_url": url, "reconcile_read_topics": False})
    publish_clean_flow(engine, Outbox(settings=settings), topic, 5)
    try:
        shown = ", ".join(f"current_setting('{name}') AS {name}"
                          for name in (*timeouts, "jit", *server_tcp))
        probe = spark.read.format("jdbc").options(
            **sources.jdbc_options(url, settings.database_tcp_timeout),
            query=f"SELECT {shown}").load().collect()
        result = job.run(spark, settings, until=datetime.now(UTC))
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {login}"))
            conn.execute(text(f"DROP ROLE {login}"))
    assert [row.asDict() for row in probe] == [
        {**dict.fromkeys(timeouts, "0"), "jit": "off", **server_tcp}]
    assert result.summary["counts"]["messages"] == 5
    assert result.outcome is RunOutcome.CLEAN


def test_a_run_reaches_the_database_through_a_url_naming_several_hosts(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A URL naming a standby and the primary (libpq's form, which the relay reads): the
    JDBC reads refused it ("needs a host"), so reconciliation could not run."""
    url = make_url(services.database_url)
    several = (f"postgresql://{devservices.DB_USER}:{devservices.DB_PASSWORD}@/{url.database}"
               f"?host=127.0.0.1:{devservices.free_port()}&host=127.0.0.1:{url.port}")
    settings = reconcile_settings(services, schema, tmp_path).model_copy(
        update={"database_url": several, "reconcile_read_topics": False})
    publish_clean_flow(engine, Outbox(settings=settings), topic, 4)
    result = job.run(spark, settings, until=datetime.now(UTC))
    assert result.summary["counts"]["messages"] == 4
