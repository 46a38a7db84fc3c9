"""Reconciliation runs that read the topics after runs that read only the tables: the
records of the windows those judged are read, and checked, by the next run that reads the
topics (nothing is left unread because a run skipped Kafka)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from pyspark.sql import SparkSession
from sqlalchemy import Engine, text

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.spark import reconcile as job
from outbox.spark.runs import RunOutcome
from tests.integration import test_reconcile
from tests.integration.test_reconcile import found, insert_message, produce, reconcile_settings
from tests.integration.test_reconcile_carry import deliver

#: The suite's one local SparkSession (test_reconcile.py's fixture).
spark = test_reconcile.spark


def test_a_topic_run_after_tables_only_runs_reads_the_records_they_judged(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """No run had read the topics: the first that did read them only from the first op
    record of its own window (here none), so the records of the messages tables-only runs
    had judged were never read: a stray record and one whose message and op record were
    deleted by hand went unreported ("0 offset ranges of 3 topics", exit 0)."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    kept = deliver(engine, services, schema, topic, age="2 hours")
    gone = deliver(engine, services, schema, topic, age="2 hours")
    produce(services.kafka_bootstrap, topic, 0, b"a", None)
    forget(engine, schema, gone)
    first = job.run(spark, tables_only, until=datetime.now(UTC))

    second = job.run(spark, settings, until=datetime.now(UTC))

    assert first.summary["counts"]["messages"] == 1, kept
    assert second.summary["counts"]["messages"] == 0
    assert second.summary["counts"]["kafka_records"] == 3
    assert found(spark, second) == {"kafka_record_without_op_record": {gone, None}}


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


def test_misplaced_op_records_a_tables_only_run_judged_are_found_by_the_next_topic_run(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A tables-only run cannot check an op record's position; the next topic run read the
    message's record as a copy found after its window was judged and reported
    delivered_more_than_once, which only reports (exit 0). One op record here points at
    the next message's record, one past the partition's end."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    onto_next, kept, past_end = (deliver(engine, services, schema, topic, age="2 hours")
                                 for _ in range(3))
    with engine.begin() as conn:
        for message_id, moved_by in ((onto_next, 1), (past_end, 100)):
            conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + "
                              f"{moved_by} WHERE message_id = :id"), {"id": message_id})
    job.run(spark, tables_only, until=datetime.now(UTC))

    second = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, second) == {"op_record_position_mismatch": {onto_next, past_end}}
    details = {r.message_id: r.detail for r in spark.read.parquet(
        str(second.output_path / "findings")).collect()}
    assert details[onto_next] == f"the record there is message {kept}"
    assert details[past_end] == "no record with an outbox-id at that position"
    assert second.outcome is RunOutcome.FAILED


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


def test_copies_of_messages_without_a_delivered_op_record_that_tables_only_runs_judged(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    """A copy in Kafka of a rolled-back message, and one of a delivered message whose op
    record was deleted, in a window a tables-only run judged: the next topic run compared
    new copies of earlier windows' messages with their DELIVERED op records only, so a
    message with none dropped out, and the run was CLEAN."""
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    unrecorded = deliver(engine, services, schema, topic, age="2 hours")
    with engine.begin() as conn:
        rolled_back = insert_message(conn, schema, topic, key=b"r", status="ROLLED_BACK",
                                     age="2 hours")
        conn.execute(text(f"INSERT INTO {schema}.op_record (message_id, action, actor) "
                          f"VALUES (:id, 'ROLLED_BACK', 'app')"), {"id": rolled_back})
        conn.execute(text(f"DELETE FROM {schema}.op_record WHERE message_id = :id"),
                     {"id": unrecorded})
    produce(services.kafka_bootstrap, topic, 1, b"r", rolled_back)
    job.run(spark, tables_only, until=datetime.now(UTC))

    second = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, second) == {"kafka_record_without_op_record": {unrecorded, rolled_back}}
    assert second.outcome is RunOutcome.FAILED


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
