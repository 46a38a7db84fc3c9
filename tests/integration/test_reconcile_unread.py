"""Reconciliation runs that read the topics after runs that read only the tables: the
records of the windows those judged are read, and checked, by the next run that reads the
topics (nothing is left unread because a run skipped Kafka)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from pyspark.sql import SparkSession
from sqlalchemy import Engine, text

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.spark import findings
from outbox.spark import reconcile as job
from outbox.spark.kafka_source import high_watermarks
from outbox.spark.runs import RunOutcome
from tests.integration import test_reconcile
from tests.integration.test_reconcile import (
    found,
    insert_message,
    produce,
    reconcile_settings,
    scenario_settings,
)
from tests.integration.test_reconcile_carry import deliver

#: The suite's one local SparkSession (test_reconcile.py's fixture).
spark = test_reconcile.spark


@dataclass
class Judged:
    """Defects in a window that only a tables-only run judged, then a topic run's result."""

    gone: int = 0          # delivered, then its message and op record deleted by hand
    onto_next: int = 0     # its op record moved onto the next message's record
    next_one: int = 0
    past_end: int = 0      # its op record moved past the partition's end
    unrecorded: int = 0    # delivered, then its op record deleted
    rolled_back: int = 0   # rolled back, with a copy in Kafka all the same
    result: job.Result | None = None


@pytest.fixture(scope="module", params=["from-the-driver", "by-spark"])
def judged(request: pytest.FixtureRequest, spark: SparkSession,
           services: devservices.Services, engine: Engine,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judged]:
    """No run read the topics before: the first that did read them only from the first op
    record of its own window (here none), so the records of the messages the tables-only
    run had judged were never read ("0 offset ranges of 3 topics", exit 0). Their messages
    are looked up from the driver (a few), or by Spark, range by range (many: here as if
    every record were too many, findings.DRIVER_LOOKUPS)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "by-spark":
            patch.setattr(findings, "DRIVER_LOOKUPS", 0)
        yield from _judged(spark, services, engine, tmp_path_factory)


def _judged(spark: SparkSession, services: devservices.Services, engine: Engine,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judged]:
    settings, topic = scenario_settings(services, tmp_path_factory.mktemp("unread"))
    schema = settings.schema_name
    d = Judged()
    kept = deliver(engine, services, schema, topic, age="2 hours")
    d.gone, d.onto_next, d.next_one, d.past_end, d.unrecorded = (
        deliver(engine, services, schema, topic, age="2 hours") for _ in range(5))
    produce(services.kafka_bootstrap, topic, 0, b"a", None)  # a stray
    forget(engine, schema, d.gone)
    with engine.begin() as conn:
        d.rolled_back = insert_message(conn, schema, topic, key=b"r", status="ROLLED_BACK",
                                       age="2 hours")
        conn.execute(text(f"INSERT INTO {schema}.op_record (message_id, action, actor) "
                          f"VALUES (:id, 'ROLLED_BACK', 'app')"), {"id": d.rolled_back})
        for message_id, moved_by in ((d.onto_next, 1), (d.past_end, 100)):
            conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + "
                              f"{moved_by} WHERE message_id = :id"), {"id": message_id})
        conn.execute(text(f"DELETE FROM {schema}.op_record WHERE message_id = :id"),
                     {"id": d.unrecorded})
    produce(services.kafka_bootstrap, topic, 1, b"r", d.rolled_back)
    first = job.run(spark, settings.model_copy(update={"reconcile_read_topics": False}),
                    until=datetime.now(UTC))
    assert first.summary["counts"]["messages"] == 6, kept
    d.result = job.run(spark, settings, until=datetime.now(UTC))
    yield d
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))


def details(spark: SparkSession, result: job.Result | None, finding: str) -> dict[int, str]:
    assert result is not None
    return {r.message_id: r.detail for r in spark.read.parquet(
        str(result.output_path / "findings")).collect() if r.finding == finding}


def test_the_topic_run_reads_every_record_of_the_window_the_tables_only_run_judged(
    judged: Judged
) -> None:
    assert judged.result is not None
    assert judged.result.summary["counts"]["messages"] == 0
    assert judged.result.summary["counts"]["kafka_records"] == 8
    assert judged.result.outcome is RunOutcome.FAILED
    assert {name: n for name, n in judged.result.counts.items() if n} == {
        "kafka_record_without_op_record": 4, "op_record_position_mismatch": 2}


def test_strays_and_records_of_deleted_messages_there_are_found(
    spark: SparkSession, judged: Judged
) -> None:
    strays = details(spark, judged.result, "kafka_record_without_op_record")
    assert strays[None] == "no valid outbox-id header"  # type: ignore[index]
    assert strays[judged.gone] == "outbox-id matches no prepare row of this topic"


def test_copies_of_messages_without_a_delivered_op_record_there_are_found(
    spark: SparkSession, judged: Judged
) -> None:
    """A copy of a rolled-back message and one of a message whose op record was deleted:
    the check compared new copies of earlier windows' messages with their DELIVERED op
    records only, so a message with none dropped out, and the run was CLEAN."""
    copies = details(spark, judged.result, "kafka_record_without_op_record")
    assert {judged.unrecorded, judged.rolled_back} <= set(copies)
    assert "has no DELIVERED op record" in copies[judged.rolled_back]


def test_misplaced_op_records_there_are_found(spark: SparkSession, judged: Judged) -> None:
    """A tables-only run cannot check an op record's position; the next topic run read the
    message's record as a copy found after its window was judged and reported
    delivered_more_than_once, which only reports (exit 0)."""
    assert details(spark, judged.result, "op_record_position_mismatch") == {
        judged.onto_next: f"the record there is message {judged.next_one}",
        judged.past_end: "no record with an outbox-id at that position"}


def test_a_topic_only_tables_only_runs_saw_is_read_by_the_next_topic_run(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A topic run read the topics of its window and those of the runs before; a topic
    delivered to only in a window that a tables-only run judged was in neither, so the next
    topic run did not read it (until a later window delivered to it again)."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    other = f"{topic}-b"
    create_topic(services.kafka_bootstrap, other, partitions=1)
    deliver(engine, services, schema, topic, age="2 hours")
    first = job.run(spark, settings, until=datetime.now(UTC))
    deliver(engine, services, schema, other, age="0 seconds")
    gone = deliver(engine, services, schema, other, age="0 seconds")
    forget(engine, schema, gone)
    stray = produce(services.kafka_bootstrap, other, 0, b"a", None)
    job.run(spark, tables_only, until=datetime.now(UTC))

    third = job.run(spark, settings, until=datetime.now(UTC))

    assert first.outcome is RunOutcome.CLEAN
    assert third.summary["counts"]["kafka_records"] == 3, stray
    assert found(spark, third) == {"kafka_record_without_op_record": {gone, None}}
    assert third.summary["kafka_offsets"][other] == {"0": 3}


def test_a_topic_recreated_and_written_past_the_last_runs_end_is_read_from_its_start(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A topic deleted and recreated, then written past where the last topic run stopped:
    its end did not show it, so the next topic run read the new log from the old end on,
    and a stray record below that end went unreported. Its first record shows it; the
    tables-only run between hands on what the topic run saw."""
    settings = reconcile_settings(services, schema, tmp_path)
    for _ in range(3):
        deliver(engine, services, schema, topic, age="2 hours")
    first = job.run(spark, settings, until=datetime.now(UTC))
    admin = KafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()
    create_topic(services.kafka_bootstrap, topic, partitions=3)
    assert high_watermarks(services.kafka_bootstrap, [topic])[(topic, 0)] == 0
    stray = produce(services.kafka_bootstrap, topic, 0, b"b", None)
    for _ in range(4):
        deliver(engine, services, schema, topic, age="0 seconds")
    job.run(spark, settings.model_copy(update={"reconcile_read_topics": False}),
            until=datetime.now(UTC))

    with caplog.at_level("WARNING", logger="outbox.reconcile"):
        third = job.run(spark, settings, until=datetime.now(UTC))

    assert first.summary["kafka_offsets"][topic]["0"] == 3
    assert found(spark, third) == {"kafka_record_without_op_record": {None}}, stray
    assert third.summary["counts"]["kafka_records"] == 1 + 4
    assert f"topic {topic} partition 0 begins with another record (offset 0" in caplog.text
    assert "deleted and recreated" in caplog.text


def forget(engine: Engine, schema: str, message_id: int) -> None:
    """Delete a delivered message and its op records by hand."""
    with engine.begin() as conn:
        for table, column in (("op_record", "message_id"), ("message", "id")):
            conn.execute(text(f"DELETE FROM {schema}.{table} WHERE {column} = :id"),
                         {"id": message_id})


def test_a_message_delivered_before_a_topic_run_read_and_judged_by_tables_only_is_checked(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A topic run reads the topics to their end, past the messages of its window: the
    records of the next window's messages delivered by then are read, and left to the run
    that judges that window. When that run read the tables only, the next topic run started
    where the topic run stopped, after those records, and never compared them with their
    op records (here one misplaced). Two tables-only runs hand the position on; a stray
    record among those read again, which the first run reported, is not reported twice."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    deliver(engine, services, schema, topic, age="2 hours")
    window_end = datetime.now(UTC)
    early = deliver(engine, services, schema, topic, age="0 seconds")
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + 100 "
                          f"WHERE message_id = :id"), {"id": early})
    produce(services.kafka_bootstrap, topic, 0, b"a", None)
    first = job.run(spark, settings, until=window_end)
    job.run(spark, tables_only, until=datetime.now(UTC) - timedelta(seconds=1))
    job.run(spark, tables_only, until=datetime.now(UTC))

    fourth = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, first) == {"kafka_record_without_op_record": {None}}
    assert found(spark, fourth) == {"op_record_position_mismatch": {early}}


def test_a_re_audit_reading_the_topics_leaves_the_next_run_what_tables_only_runs_judged(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A re-audit of an old window with the topics read them to their end and recorded
    that end as where the next topic run starts: the records of a window that a tables-only
    run had judged in between were read by the re-audit as a later window's, and by no run
    as their own (here a misplaced op record)."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    deliver(engine, services, schema, topic, age="2 hours")
    first = job.run(spark, settings, until=datetime.now(UTC))
    misplaced = deliver(engine, services, schema, topic, age="0 seconds")
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + 100 "
                          f"WHERE message_id = :id"), {"id": misplaced})
    job.run(spark, tables_only, until=datetime.now(UTC))
    again = job.run(spark, settings, since=datetime(2000, 1, 1, tzinfo=UTC),
                    until=first.window.until)

    fourth = job.run(spark, settings, until=datetime.now(UTC))

    assert again.outcome is RunOutcome.CLEAN
    assert found(spark, fourth) == {"op_record_position_mismatch": {misplaced}}
