"""Nothing escapes reconciliation because its window passed (issue 15, "no blind spots"):
messages still open are carried into later runs until they are settled and judged, and the
per-key order check starts where the last run left each key."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from sqlalchemy import Connection, Engine, text

from outbox.dev import services as devservices
from outbox.spark import reconcile as job
from tests.conftest import running_relay, wait_delivered
from tests.integration import test_reconcile
from tests.integration.test_reconcile import found, insert_message, produce, reconcile_settings

#: The suite's one local SparkSession (test_reconcile.py's fixture).
spark = test_reconcile.spark


@pytest.mark.slow
def test_messages_left_open_are_judged_by_later_runs_until_they_are_delivered(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    settings = reconcile_settings(services, schema, tmp_path)
    with engine.begin() as conn:
        late = insert_message(conn, schema, topic, key=b"late", age="1 hour")
        misplaced = insert_message(conn, schema, topic, key=b"misplaced", age="1 hour")
        never = insert_message(conn, schema, topic, key=b"never", age="1 hour",
                               status="PARKED")
    first = job.run(spark, settings, until=datetime.now(UTC))
    with running_relay(settings):  # delivers the two PENDING ones, after run 1's window
        wait_delivered(engine, schema, 2)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + 100 "
                          f"WHERE message_id = :id"), {"id": misplaced})

    second = job.run(spark, settings, until=datetime.now(UTC))
    third = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, first)["undelivered_after_sla"] == {late, misplaced, never}
    assert second.window.since == first.window.until
    in_second = found(spark, second)
    assert in_second.get("undelivered_after_sla") == {never}
    assert in_second.get("op_record_position_mismatch") == {misplaced}
    assert late not in set().union(*in_second.values())
    assert found(spark, third).get("undelivered_after_sla") == {never}
    assert second.summary["counts"]["messages"] == 0
    assert second.summary["counts"]["carried_in"] == 3
    assert third.summary["counts"]["carried_in"] == 1


def test_a_run_whose_predecessor_left_no_carry_judges_what_the_tables_show_open(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last run's carry is gone (its folder deleted, or written where this run cannot
    read). The messages it left open were judged by no later run, with a warning and exit
    0: one never delivered escaped for good. Now the tables stand in: messages before the
    window with a pending row, or an op record written since."""
    settings = reconcile_settings(services, schema, tmp_path)
    with engine.begin() as conn:
        misplaced = insert_message(conn, schema, topic, key=b"misplaced", age="1 hour")
        never = insert_message(conn, schema, topic, key=b"never", age="1 hour",
                               status="PARKED")
    first = job.run(spark, settings, until=datetime.now(UTC))
    shutil.rmtree(first.output_path / "carry")
    with running_relay(settings):  # delivers the PENDING one, after run 1's window
        wait_delivered(engine, schema, 1)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.op_record SET kafka_offset = kafka_offset + 100 "
                          f"WHERE message_id = :id"), {"id": misplaced})

    with caplog.at_level("WARNING", logger="outbox.reconcile"):
        second = job.run(spark, settings, until=datetime.now(UTC))

    assert found(spark, first)["undelivered_after_sla"] == {misplaced, never}
    assert found(spark, second) == {"undelivered_after_sla": {never},
                                    "op_record_position_mismatch": {misplaced}}
    assert second.summary["counts"]["carried_in"] == 2
    assert "left nothing to carry over" in caplog.text
    assert "judging again the 2 messages" in caplog.text


def test_a_relative_output_folder_still_hands_the_carry_to_a_run_started_elsewhere(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run recorded its folder as given (the default is `reconcile-output`, relative):
    the next run, started from another folder (by hand, a re-audit, or a scheduler that
    changes it), looked for the carry there, found nothing, and judged no open message
    again."""
    (tmp_path / "cron").mkdir()
    (tmp_path / "by-hand").mkdir()
    settings = reconcile_settings(services, schema, Path("reports"))
    with engine.begin() as conn:
        open_id = insert_message(conn, schema, topic, key=b"open", age="1 hour",
                                 status="PARKED")
    monkeypatch.chdir(tmp_path / "cron")
    first = job.run(spark, settings, until=datetime.now(UTC))
    monkeypatch.chdir(tmp_path / "by-hand")
    second = job.run(spark, settings, until=datetime.now(UTC))

    assert first.output_path.is_absolute(), first.output_path
    assert first.output_path.is_relative_to(tmp_path / "cron" / "reports")
    assert second.summary["counts"]["carried_in"] == 1
    assert found(spark, second).get("undelivered_after_sla") == {open_id}


@pytest.mark.parametrize("read_topics", [True, False], ids=["with-topics", "tables-only"])
def test_a_reorder_across_two_windows_is_found(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path, read_topics: bool
) -> None:
    settings = reconcile_settings(services, schema, tmp_path).model_copy(
        update={"reconcile_read_topics": read_topics})
    with engine.begin() as conn:
        earlier = insert_message(conn, schema, topic, key=b"k", status="DELIVERED",
                                 age="1 hour")
        later = insert_message(conn, schema, topic, key=b"k", status="DELIVERED")
        for message_id in (later, earlier):  # the later message lands first
            offset = produce(services.kafka_bootstrap, topic, 0, b"k", message_id)
            record_delivery(conn, schema, message_id, offset)

    first = job.run(spark, settings, until=datetime.now(UTC) - timedelta(minutes=30))
    second = job.run(spark, settings, until=datetime.now(UTC))

    assert first.summary["counts"]["messages"] == 1 and first.counts["key_order_broken"] == 0
    assert second.summary["counts"]["messages"] == 1
    assert found(spark, second).get("key_order_broken") == {later}


def test_a_tables_only_run_between_two_topic_runs_hides_no_stray_record(
    spark: SparkSession, services: devservices.Services, engine: Engine, schema: str,
    topic: str, tmp_path: Path
) -> None:
    settings = reconcile_settings(services, schema, tmp_path)
    tables_only = settings.model_copy(update={"reconcile_read_topics": False})
    deliver(engine, services, schema, topic, age="2 hours")
    first = job.run(spark, settings, until=datetime.now(UTC))
    produce(services.kafka_bootstrap, topic, 0, b"a", None)  # after the first run read
    job.run(spark, tables_only, until=datetime.now(UTC))
    deliver(engine, services, schema, topic, age="0 seconds")

    third = job.run(spark, settings, until=datetime.now(UTC))

    assert first.counts["kafka_record_without_op_record"] == 0
    assert found(spark, third).get("kafka_record_without_op_record") == {None}


def deliver(engine: Engine, services: devservices.Services, schema: str, topic: str,
            age: str) -> int:
    """A message of key ``a`` delivered to partition 0 with its op record, as the relay
    would."""
    with engine.begin() as conn:
        message_id = insert_message(conn, schema, topic, key=b"a", status="DELIVERED", age=age)
        offset = produce(services.kafka_bootstrap, topic, 0, b"a", message_id)
        record_delivery(conn, schema, message_id, offset)
    return message_id


def record_delivery(conn: Connection, schema: str, message_id: int, offset: int) -> None:
    conn.execute(text(
        f"INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, "
        f"kafka_offset) VALUES (:id, 'DELIVERED', 'relay', 0, :offset)"),
        {"id": message_id, "offset": offset})
