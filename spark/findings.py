"""What the reconciliation looks for: each finding, its default threshold, and how it is found.

Every finding is a DataFrame with the same columns (``FINDING_SCHEMA``), one row per message
or per Kafka record involved, so all of them land in one Parquet dataset. Most are filters
over ``facts``: one row per message of the window with what its op records and the topic say
about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from outbox.exceptions import ConfigurationError
from outbox.schema import Action, Resolution, Status


@dataclass(frozen=True)
class Finding:
    name: str
    title: str
    #: The run fails when more than this many are found; None: reported, never fails a run.
    threshold: int | None
    #: Only found when the run reads the Kafka topics.
    needs_topics: bool = False


FINDINGS = (
    Finding("undelivered_after_sla", "committed but not delivered within the SLA", 0),
    # At-least-once delivery: a relay dying between the broker's ack and its op record sends
    # the batch again. Consumers deduplicate on outbox-id; the chaos test bounds the rate.
    Finding("delivered_more_than_once", "delivered more than once", None),
    Finding("delivered_although_rolled_back",
            "delivered although rolled back, discarded or never committed", 0),
    Finding("op_record_without_message", "op records without a prepare row", 0),
    Finding("kafka_record_without_op_record", "records in Kafka with no op record", 0,
            needs_topics=True),
    Finding("op_record_position_mismatch",
            "op records whose partition/offset does not hold that message", 0, needs_topics=True),
    Finding("key_order_broken", "per-key order broken", 0),
    # The sweeper is still checking these back: a state to watch, not an error yet.
    Finding("stuck_unknown", "rows stuck UNKNOWN past the SLA", None),
    # A designed, kept and resumable outcome of 15 inconclusive check-backs.
    Finding("discarded", "discarded rows", None),
)
BY_NAME = {finding.name: finding for finding in FINDINGS}
FINDING_SCHEMA = (
    "finding string, message_id long, topic string, partition int, offset long, detail string"
)


def thresholds(overrides: Mapping[str, int | None]) -> dict[str, int | None]:
    """The default thresholds with ``overrides`` applied; unknown names are an error."""
    unknown = sorted(set(overrides) - set(BY_NAME))
    if unknown:
        raise ConfigurationError(
            f"unknown finding {', '.join(unknown)} in thresholds; known: {', '.join(BY_NAME)}")
    negative = sorted(name for name, value in overrides.items() if value is not None and value < 0)
    if negative:
        raise ConfigurationError(f"threshold of {', '.join(negative)} must be 0 or more")
    return {f.name: overrides.get(f.name, f.threshold) for f in FINDINGS}


@dataclass
class Inputs:
    """What one run reads. ``records`` is None when the topics are not read."""

    #: The window's prepare rows (queries.messages_in_window).
    messages: DataFrame
    #: Op records of the window's messages, with their topic (window_op_records).
    op_records: DataFrame
    #: Op records written in the window whose prepare row does not exist.
    orphans: DataFrame
    #: Kafka records read: topic, partition, offset, key, outbox_id, fresh (not seen before).
    records: DataFrame | None
    #: outbox ids of fresh records that match no prepare row at all.
    unknown_ids: DataFrame | None
    now: datetime
    sla_seconds: float

    @property
    def cutoff(self) -> datetime:
        """Messages due before this have had the whole SLA to be delivered."""
        return self.now - timedelta(seconds=self.sla_seconds)


def window_op_records(op_records: DataFrame, messages: DataFrame) -> DataFrame:
    """Op records of the window's messages (the id range also holds others), with the topic."""
    return op_records.join(messages.select(F.col("id").alias("message_id"), "topic"),
                           "message_id")


def facts(inputs: Inputs) -> DataFrame:
    """One row per window message: its row, its op records' summary, its copies in Kafka."""
    delivered = F.col("action") == Action.DELIVERED.value
    per_message = inputs.op_records.groupBy("message_id").agg(
        F.count(F.lit(1)).alias("op_count"),
        F.count(F.when(delivered, 1)).alias("delivered_ops"),
        F.min(F.when(delivered, F.struct(
            F.col("kafka_partition").alias("partition"),
            F.col("kafka_offset").alias("offset")))).alias("op_position"),
    )
    joined = inputs.messages.join(
        per_message.withColumnRenamed("message_id", "id"), "id", "left")
    if inputs.records is None:
        return joined.select(
            "*", F.lit(0).cast("long").alias("kafka_copies"),
            F.lit(None).cast("struct<partition:int,offset:long>").alias("kafka_position"))
    copies = inputs.records.where(F.col("outbox_id").isNotNull()).groupBy("outbox_id").agg(
        F.count(F.lit(1)).alias("kafka_copies"),
        F.min(F.struct("partition", "offset")).alias("kafka_position"),
    ).withColumnRenamed("outbox_id", "id")
    return joined.join(copies, "id", "left")


def find(inputs: Inputs, facts: DataFrame) -> DataFrame:
    """All findings of the run, as one DataFrame of ``FINDING_SCHEMA``."""
    found = [
        undelivered_after_sla(facts, inputs.cutoff),
        delivered_more_than_once(facts),
        delivered_although_rolled_back(facts),
        op_record_without_message(inputs.orphans),
        key_order_broken(facts, topics_read=inputs.records is not None),
        stuck_unknown(facts, inputs.cutoff),
        discarded(facts),
    ]
    if inputs.records is not None:
        found += [
            kafka_record_without_op_record(facts, inputs.records, inputs.unknown_ids),
            op_record_position_mismatch(inputs.op_records, inputs.records),
        ]
    return reduce(DataFrame.unionByName, found)


def _finding(df: DataFrame, name: str, detail: Column, *, message_id: Column | None = None,
             topic: Column | None = None, position: Column | None = None) -> DataFrame:
    assert name in BY_NAME
    return df.select(
        F.lit(name).alias("finding"),
        (message_id if message_id is not None else F.col("id")).cast("long").alias("message_id"),
        (topic if topic is not None else F.col("topic")).alias("topic"),
        (position.partition if position is not None else F.lit(None)).cast("int")
        .alias("partition"),
        (position.offset if position is not None else F.lit(None)).cast("long").alias("offset"),
        detail.alias("detail"),
    )


def _copies() -> Column:
    return F.coalesce(F.col("kafka_copies"), F.lit(0))


def _delivered_ops() -> Column:
    return F.coalesce(F.col("delivered_ops"), F.lit(0))


def _ts(column: str) -> Column:
    return F.date_format(column, "yyyy-MM-dd HH:mm:ss'Z'")


def _due() -> Column:
    """Delayed messages are due at deliver_after, others when they were written."""
    return F.greatest("created_at", "deliver_after")


def undelivered_after_sla(facts: DataFrame, cutoff: datetime) -> DataFrame:
    late = facts.where(
        (F.col("resolution") == Resolution.COMMIT.value) & (_due() < F.lit(cutoff))
        & (_delivered_ops() == 0) & (_copies() == 0))
    return _finding(late, "undelivered_after_sla", F.concat(
        F.format_string("status %s, due %s, %d attempts",
                        "status", F.date_format(_due(), "yyyy-MM-dd HH:mm:ss'Z'"), "attempts"),
        F.coalesce(F.concat(F.lit(", last error: "), "last_error"), F.lit(""))))


def delivered_more_than_once(facts: DataFrame) -> DataFrame:
    twice = facts.where(F.greatest(_delivered_ops(), _copies()) > 1)
    return _finding(
        twice, "delivered_more_than_once",
        F.format_string("%d copies in Kafka, %d DELIVERED op records", _copies(),
                        _delivered_ops()),
        position=F.coalesce("kafka_position", "op_position"))


def delivered_although_rolled_back(facts: DataFrame) -> DataFrame:
    not_committed = (F.col("resolution") != Resolution.COMMIT.value) | F.col("status").isin(
        Status.ROLLED_BACK.value, Status.DISCARDED.value)
    wrong = facts.where(not_committed & ((_delivered_ops() > 0) | (_copies() > 0)))
    return _finding(
        wrong, "delivered_although_rolled_back",
        F.format_string("resolution %s, status %s; %d copies in Kafka, %d DELIVERED op records",
                        "resolution", "status", _copies(), _delivered_ops()),
        position=F.coalesce("kafka_position", "op_position"))


def op_record_without_message(orphans: DataFrame) -> DataFrame:
    return _finding(
        orphans, "op_record_without_message",
        F.format_string("op record %d: %s by %s at %s", "id", "action", "actor",
                        _ts("created_at")),
        message_id=F.col("message_id"), topic=F.lit(None).cast("string"),
        position=F.struct(F.col("kafka_partition").alias("partition"),
                          F.col("kafka_offset").alias("offset")))


def kafka_record_without_op_record(facts: DataFrame, records: DataFrame,
                                   unknown_ids: DataFrame | None) -> DataFrame:
    """Committed window messages in Kafka without an op record, and fresh stray records."""
    unrecorded = facts.where(
        (F.col("resolution") == Resolution.COMMIT.value)
        & ~F.col("status").isin(Status.ROLLED_BACK.value, Status.DISCARDED.value)
        & (_copies() > 0) & (_delivered_ops() == 0))
    by_message = _finding(
        unrecorded, "kafka_record_without_op_record",
        F.format_string("status %s; %d copies in Kafka, no DELIVERED op record", "status",
                        _copies()),
        position=F.col("kafka_position"))
    fresh = records.where("fresh")
    no_id = fresh.where(F.col("outbox_id").isNull())
    if unknown_ids is not None:
        no_id = no_id.unionByName(fresh.join(unknown_ids, "outbox_id", "left_semi"))
    strays = _finding(
        no_id, "kafka_record_without_op_record",
        F.when(F.col("outbox_id").isNull(), F.lit("no valid outbox-id header"))
        .otherwise(F.lit("outbox-id matches no prepare row")),
        message_id=F.col("outbox_id"), topic=F.col("topic"),
        position=F.struct("partition", "offset"))
    return by_message.unionByName(strays)


def op_record_position_mismatch(ops: DataFrame, records: DataFrame) -> DataFrame:
    """DELIVERED op records whose topic, partition and offset hold another record, or none."""
    claimed = ops.where(F.col("action") == Action.DELIVERED.value).select(
        "message_id", "topic", F.col("kafka_partition").alias("partition"),
        F.col("kafka_offset").alias("offset"))
    held = records.select(F.col("outbox_id").alias("message_id"), "topic", "partition", "offset")
    wrong = claimed.join(held, ["message_id", "topic", "partition", "offset"], "left_anti")
    found = wrong.join(
        records.select("topic", "partition", "offset", F.col("outbox_id").alias("found_id")),
        ["topic", "partition", "offset"], "left")
    return _finding(
        found, "op_record_position_mismatch",
        F.when(F.col("partition").isNull() | F.col("offset").isNull(),
               F.lit("DELIVERED op record without partition/offset"))
        .when(F.col("found_id").isNotNull(),
              F.format_string("the record there is message %d", "found_id"))
        .otherwise(F.lit("no record with an outbox-id at that position")),
        message_id=F.col("message_id"), position=F.struct("partition", "offset"))


def key_order_broken(facts: DataFrame, *, topics_read: bool) -> DataFrame:
    """Within a (topic, key), positions must grow with message id, all in one partition.

    Positions are the first copy in Kafka when the topics are read, else the op records';
    later duplicates do not count (consumers deduplicate them on outbox-id).
    """
    position = F.col("kafka_position" if topics_read else "op_position")
    placed = facts.where(F.col("key").isNotNull() & position.isNotNull()).select(
        "id", "topic", "key", position.alias("position"))
    by_key = Window.partitionBy("topic", "key").orderBy("id")
    compared = placed.select(
        "*", F.lag("id").over(by_key).alias("prev_id"),
        F.lag("position").over(by_key).alias("prev"))
    broken = compared.where(
        F.col("prev_id").isNotNull()
        & ((F.col("position.partition") != F.col("prev.partition"))
           | (F.col("position.offset") < F.col("prev.offset"))))
    return _finding(
        broken, "key_order_broken",
        F.format_string("key %s: at %d/%d, but the earlier message %d is at %d/%d",
                        F.col("key").cast("string"), "position.partition", "position.offset",
                        "prev_id", "prev.partition", "prev.offset"),
        position=F.col("position"))


def stuck_unknown(facts: DataFrame, cutoff: datetime) -> DataFrame:
    stuck = facts.where(
        (F.col("resolution") == Resolution.UNKNOWN.value)
        & F.col("status").isin(Status.PENDING.value, Status.DELAYED.value)
        & (F.col("created_at") < F.lit(cutoff)))
    return _finding(stuck, "stuck_unknown", F.format_string(
        "%d check-backs, created %s, next check %s", "check_count", _ts("created_at"),
        F.coalesce(_ts("next_check_at"), F.lit("none"))))


def discarded(facts: DataFrame) -> DataFrame:
    gone = facts.where(F.col("status") == Status.DISCARDED.value)
    return _finding(gone, "discarded", F.concat(
        F.format_string("resolution %s after %d check-backs", "resolution", "check_count"),
        F.coalesce(F.concat(F.lit(", last error: "), "last_error"), F.lit(""))))


# --- statistics ------------------------------------------------------------------------------

PERCENTILES = (0.5, 0.9, 0.99)


def stats(messages: DataFrame) -> dict[str, Any]:
    """Counts by topic and resolution, delivery latency percentiles, check-back histogram."""
    counts = [
        {"topic": r.topic, "resolution": r.resolution, "status": r.status, "count": r["count"]}
        for r in messages.groupBy("topic", "resolution", "status").count()
        .orderBy("topic", "resolution", "status").collect()
    ]
    latency = (F.unix_micros("delivered_at") - F.unix_micros("created_at")) / 1e6
    delivered = messages.where(F.col("delivered_at").isNotNull()).select(
        "topic", latency.alias("seconds"))
    summary = [
        F.count(F.lit(1)).alias("delivered"),
        F.percentile_approx("seconds", list(PERCENTILES), 10_000).alias("percentiles"),
        F.max("seconds").alias("max"),
    ]
    rows = delivered.groupBy("topic").agg(*summary).orderBy("topic").collect()
    total = delivered.agg(*summary).collect()
    latencies = [_latency(r, r.topic) for r in rows] + [_latency(r, "*") for r in total
                                                        if r.delivered]
    histogram = [
        {"check_count": r.check_count, "messages": r["count"]}
        for r in messages.groupBy("check_count").count().orderBy("check_count").collect()
    ]
    return {"counts": counts, "latency_seconds": latencies, "check_backs": histogram}


def _latency(row: Any, topic: str) -> dict[str, Any]:
    values = dict(zip((f"p{round(q * 100)}" for q in PERCENTILES), row.percentiles or (),
                      strict=False))
    return {"topic": topic, "delivered": row.delivered, **values, "max": row.max}
