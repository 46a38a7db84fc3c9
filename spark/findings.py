"""What the reconciliation looks for: each finding, its default threshold, and how it is found.

Every finding is a DataFrame with the same columns (finding, message_id, topic, partition,
offset, detail), one row per message or per Kafka record involved, so all of them land in one
Parquet dataset. Most are filters (:class:`Rule`) over ``facts``: one row per message of the
window with what its op records and the topic say about it; they are all found in one pass.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from outbox.findings import BY_NAME
from outbox.schema import Resolution, Status
from outbox.spark.queries import POSITION_OFFSET_BITS


@dataclass
class Inputs:
    """What one run reads. ``records`` is None when the topics are not read."""

    #: The window's prepare rows with their op records summed up (queries.message_facts).
    messages: DataFrame
    #: Op records written in the window whose prepare row does not exist.
    orphans: DataFrame
    #: Kafka records read: topic, partition, offset, outbox_id, fresh (not seen before),
    #: recheck (fresh, or seen before and to be checked again: sources.TopicPlan).
    records: DataFrame | None
    now: datetime
    sla_seconds: float
    #: The last placed message per (topic, key) before this run (carry.last_by_key).
    anchors: DataFrame | None = None

    @property
    def cutoff(self) -> datetime:
        """Messages due before this have had the whole SLA to be delivered."""
        return self.now - timedelta(seconds=self.sla_seconds)


def _position(partition: Column, offset: Column) -> Column:
    """The encoding queries.message_facts uses, so positions compare as one long."""
    return F.shiftleft(partition.cast("long"), POSITION_OFFSET_BITS).bitwiseOR(offset)


def _partition_of(position: str) -> Column:
    return F.shiftright(F.col(position), POSITION_OFFSET_BITS).cast("int")


def _offset_of(position: str) -> Column:
    return F.col(position).bitwiseAND((1 << POSITION_OFFSET_BITS) - 1)


@dataclass(frozen=True)
class Judged:
    """Messages of earlier windows with copies to check (see :func:`copied_after_judged`):
    ``messages`` (topic, outbox_id, rechecked) and their DELIVERED op records, ``claims``
    (id, topic, partition, offset, checked); ``few``: small enough to broadcast."""

    messages: DataFrame
    claims: DataFrame
    few: bool = True


def joined(inputs: Inputs) -> DataFrame:
    """The window's messages fully joined with their copies in Kafka, per (topic, id).

    Rows with ``in_window`` are the facts the findings filter; rows without it are Kafka
    records whose outbox-id is no message of the window (see :func:`foreign`).
    """
    messages = inputs.messages.withColumn("in_window", F.lit(True))
    if inputs.records is None:
        return messages.select("*", F.lit(0).cast("long").alias("kafka_copies"),
                               F.lit(None).cast("long").alias("copy_at"),
                               F.lit(None).cast("boolean").alias("fresh"),
                               F.lit(None).cast("boolean").alias("recheck"))
    copies = inputs.records.where(F.col("outbox_id").isNotNull()).groupBy(
        "topic", F.col("outbox_id").alias("id")).agg(
        F.count(F.lit(1)).alias("kafka_copies"),
        F.min(_position(F.col("partition"), F.col("offset"))).alias("copy_at"),
        F.max("fresh").alias("fresh"), F.max("recheck").alias("recheck"))
    return messages.join(copies, ["topic", "id"], "full")


def facts(joined: DataFrame) -> DataFrame:
    """One row per window message: its row, its op records' summary, its Kafka copies."""
    return joined.where(F.col("in_window")).withColumn(
        "kafka_copies", F.coalesce("kafka_copies", F.lit(0)))


#: Records outside the window are looked up by ranges of 2**LOOKUP_BITS message ids when
#: there are more than DRIVER_LOOKUPS of them: their ids, collected to the driver one by one,
#: cost it 1.2 GB for a million (a topic run after a day of tables-only runs reads every
#: record of that day); Spark reads the prepare rows and op records of the ranges itself
#: (reconcile._outside). Fewer are looked up from the driver: a Spark read of their ranges
#: cost a small run about 3 s more.
LOOKUP_BITS = 12
DRIVER_LOOKUPS = 50_000


def to_look_up(joined: DataFrame, facts: DataFrame) -> DataFrame:
    """What a run reading the topics looks up in the database before it judges, in one Spark
    job (each costs about 0.3 s on a small window): rows of (id, delivered_ops, topic,
    fresh) and two flags, of two kinds. Up to DRIVER_LOOKUPS + 1 records of :func:`outside`
    (``topic``, ``id``, ``fresh``); and messages flagged ``several``: more than one
    DELIVERED op record or copy, checked record by record; or ``unrecorded``: committed, in
    Kafka, without a DELIVERED op record in the tables as read (those recorded since,
    delivered while the run read, are no finding)."""
    flags = facts.where(_several() | _copied_unrecorded()).select(
        "id", "delivered_ops", F.lit(None).cast("string").alias("topic"),
        F.lit(None).cast("boolean").alias("fresh"), _several().alias("several"),
        _copied_unrecorded().alias("unrecorded"))
    return flags.unionByName(outside(joined).limit(DRIVER_LOOKUPS + 1).select(
        F.col("outbox_id").alias("id"),
        F.lit(None).cast(facts.schema["delivered_ops"].dataType).alias("delivered_ops"),
        "topic", "fresh", F.lit(False).alias("several"), F.lit(False).alias("unrecorded")))


def id_buckets(outside: DataFrame) -> list[int]:
    """The ranges of 2**LOOKUP_BITS message ids that records of :func:`outside` name."""
    return sorted(r.bucket for r in outside.select(F.shiftright(
        "outbox_id", LOOKUP_BITS).alias("bucket")).distinct().collect())


def outside(joined: DataFrame) -> DataFrame:
    """The new Kafka records, and those to check again, whose outbox-id is no message of the
    window: (topic, outbox_id, fresh), a row per message."""
    return joined.where(F.col("in_window").isNull() & F.col("recheck")).select(
        "topic", F.col("id").alias("outbox_id"), "fresh")


def _several() -> Column:
    return (F.col("delivered_ops") > 1) | (F.col("kafka_copies") > 1)


def find(inputs: Inputs, facts: DataFrame, unknown: DataFrame | None,
         claims: DataFrame | None, recorded_since: Collection[int] = (),
         judged: Judged | None = None) -> DataFrame:
    """All findings of the run, as one DataFrame of the columns named above.

    ``unknown``: (topic, outbox_id) of new records that match no prepare row at all;
    ``claims``: (id, topic, partition, offset) of each DELIVERED op record of the messages
    :func:`to_look_up` flags ``several``; ``recorded_since``: of those it flags
    ``unrecorded``, the ones recorded once the tables were read;
    ``judged``: the messages of earlier windows with copies to check, and their claims
    (see :func:`copied_after_judged`).
    """
    rules = [
        undelivered_after_sla(inputs.cutoff),
        delivered_more_than_once(),
        delivered_although_rolled_back(),
        stuck_unknown(inputs.cutoff),
        discarded(),
    ]
    if inputs.records is not None:
        rules.append(copied_without_op_record(recorded_since))
    found = [
        by_message(facts, rules),
        op_record_without_message(inputs.orphans),
        key_order_broken(facts, topics_read=inputs.records is not None,
                         anchors=inputs.anchors),
    ]
    if inputs.records is not None:
        assert claims is not None
        found += [
            stray_records(inputs.records, unknown, judged is None or judged.few),
            op_record_position_mismatch(facts, claims, inputs.records),
        ]
    if inputs.records is not None and judged is not None:
        found += copied_after_judged(inputs.records, judged)
    return reduce(DataFrame.unionByName, found)


@dataclass(frozen=True)
class Rule:
    """A finding that is a filter over ``facts``: which messages, what to say, and where
    (an encoded position column, or None)."""

    name: str
    where: Column
    detail: Column
    at: Column | None = None


def by_message(facts: DataFrame, rules: list[Rule]) -> DataFrame:
    """The findings of ``rules``, in one pass over ``facts`` (one scan of the cached rows
    rather than one per finding); a message matching several rules yields a row for each."""
    assert all(rule.name in BY_NAME for rule in rules)
    matches = F.array(*[
        F.when(rule.where, F.struct(
            F.lit(rule.name).alias("finding"), rule.detail.alias("detail"),
            (rule.at if rule.at is not None else F.lit(None)).cast("long").alias("at")))
        for rule in rules])
    return facts.where(reduce(Column.__or__, [rule.where for rule in rules])).select(
        "id", "topic", F.explode(F.filter(matches, lambda m: m.isNotNull())).alias("m")
    ).select(
        "m.finding",
        F.col("id").cast("long").alias("message_id"),
        "topic",
        _partition_of("m.at").alias("partition"),
        _offset_of("m.at").cast("long").alias("offset"),
        "m.detail",
    )


def _finding(df: DataFrame, name: str, detail: Column, *, message_id: str = "id",
             topic: Column | None = None, position: str | None = None,
             partition: str = "partition", offset: str = "offset") -> DataFrame:
    """Rows of one finding; ``position`` names an encoded position column, else
    ``partition`` and ``offset`` name plain ones (when present)."""
    assert name in BY_NAME
    if position is not None:
        where = [_partition_of(position), _offset_of(position)]
    elif partition in df.columns:
        where = [F.col(partition), F.col(offset)]
    else:
        where = [F.lit(None), F.lit(None)]
    return df.select(
        F.lit(name).alias("finding"),
        F.col(message_id).cast("long").alias("message_id"),
        (topic if topic is not None else F.col("topic")).alias("topic"),
        where[0].cast("int").alias("partition"),
        where[1].cast("long").alias("offset"),
        detail.alias("detail"),
    )


def _ts(column: Column | str) -> Column:
    return F.date_format(column, "yyyy-MM-dd HH:mm:ss'Z'")


def _due() -> Column:
    """Delayed messages are due at deliver_after, others when they were written."""
    return F.greatest("created_at", "deliver_after")


def _first_copy_or_op() -> Column:
    return F.coalesce("copy_at", "op_at")


def undelivered_after_sla(cutoff: datetime) -> Rule:
    return Rule(
        "undelivered_after_sla",
        (F.col("resolution") == Resolution.COMMIT.value) & (_due() < F.lit(cutoff))
        & (F.col("delivered_ops") == 0) & (F.col("kafka_copies") == 0),
        F.concat(
            F.format_string("status %s, due %s, %d attempts", "status", _ts(_due()),
                            "attempts"),
            F.coalesce(F.concat(F.lit(", last error: "), "last_error"), F.lit(""))))


def delivered_more_than_once() -> Rule:
    return Rule(
        "delivered_more_than_once", _several(),
        F.format_string("%d copies in Kafka, %d DELIVERED op records", "kafka_copies",
                        "delivered_ops"),
        _first_copy_or_op())


def delivered_although_rolled_back() -> Rule:
    not_committed = (F.col("resolution") != Resolution.COMMIT.value) | F.col("status").isin(
        Status.ROLLED_BACK.value, Status.DISCARDED.value)
    return Rule(
        "delivered_although_rolled_back",
        not_committed & ((F.col("delivered_ops") > 0) | (F.col("kafka_copies") > 0)),
        F.format_string("resolution %s, status %s; %d copies in Kafka, %d DELIVERED op records",
                        "resolution", "status", "kafka_copies", "delivered_ops"),
        _first_copy_or_op())


def op_record_without_message(orphans: DataFrame) -> DataFrame:
    return _finding(
        orphans, "op_record_without_message",
        F.format_string("op record %d: %s by %s at %s", "id", "action", "actor",
                        _ts("created_at")),
        message_id="message_id", topic=F.lit(None).cast("string"),
        partition="kafka_partition", offset="kafka_offset")


def _copied_unrecorded() -> Column:
    return ((F.col("resolution") == Resolution.COMMIT.value)
            & ~F.col("status").isin(Status.ROLLED_BACK.value, Status.DISCARDED.value)
            & (F.col("kafka_copies") > 0) & (F.col("delivered_ops") == 0))


def copied_without_op_record(recorded_since: Collection[int]) -> Rule:
    """Committed window messages in Kafka without a DELIVERED op record (``recorded_since``:
    those that have one now, written after the tables were read)."""
    return Rule(
        "kafka_record_without_op_record",
        _copied_unrecorded() & ~F.col("id").isin(sorted(recorded_since)),
        F.format_string("status %s; %d copies in Kafka, no DELIVERED op record", "status",
                        "kafka_copies"),
        F.col("copy_at"))


def stray_records(records: DataFrame, unknown: DataFrame | None, few: bool = True
                  ) -> DataFrame:
    """New records without an outbox-id, or whose outbox-id is no message of their topic
    (also kafka_record_without_op_record); ``few``: ``unknown`` is small enough to
    broadcast."""
    fresh = records.where("fresh")
    strays = fresh.where(F.col("outbox_id").isNull())
    if unknown is not None:
        strays = strays.unionByName(fresh.join(
            F.broadcast(unknown) if few else unknown, ["topic", "outbox_id"], "left_semi"))
    return _finding(
        strays, "kafka_record_without_op_record",
        F.when(F.col("outbox_id").isNull(), F.lit("no valid outbox-id header"))
        .otherwise(F.lit("outbox-id matches no prepare row of this topic")),
        message_id="outbox_id")


def copied_after_judged(records: DataFrame, judged: Judged) -> list[DataFrame]:
    """Copies of messages of an earlier window, which an earlier run judged (from the tables
    alone, if it read no topic): the new ones, and those seen before when the message is
    ``rechecked`` (only tables-only runs judged it; its records are read again,
    ``recheck``), checked against the message's DELIVERED op records (``claims``, with
    ``checked``: the position lies where this run read its partition).

    A copy of a message without any is kafka_record_without_op_record. A checked op record
    whose position holds no record of its message is misplaced; a copy at none of the op
    records is one copy more, unless its message has as many misplaced op records as such
    copies (the op record names the wrong place, as for one message of the window with one
    op record and one copy: :func:`op_record_position_mismatch`)."""
    claims = judged.claims
    hint = F.broadcast if judged.few else _as_is
    copies = records.join(hint(judged.messages), ["topic", "outbox_id"], "inner").where(
        F.col("fresh") | (F.col("recheck") & F.col("rechecked")))
    claimed = claims.select("topic", F.col("id").alias("outbox_id"), "partition", "offset")
    held = records.select("topic", "outbox_id", "partition", "offset")
    wrong = claims.where("checked").join(
        held.withColumnRenamed("outbox_id", "id"), ["id", "topic", "partition", "offset"],
        "left_anti").select("id", "topic", "partition", "offset")
    first_claim = claims.groupBy("topic", F.col("id").alias("outbox_id")).agg(
        F.min(_position(F.col("partition"), F.col("offset"))).alias("op_at"))
    unclaimed = copies.join(hint(first_claim), ["topic", "outbox_id"], "left_anti")
    extra = copies.join(hint(first_claim), ["topic", "outbox_id"], "inner").join(
        hint(claimed), ["topic", "outbox_id", "partition", "offset"], "left_anti")
    explained = extra.groupBy("topic", "outbox_id").agg(F.count(F.lit(1)).alias("extra")).join(
        wrong.groupBy("topic", F.col("id").alias("outbox_id")).agg(
            F.count(F.lit(1)).alias("wrong")), ["topic", "outbox_id"]
    ).where(F.col("extra") <= F.col("wrong"))
    return [
        _finding(unclaimed, "kafka_record_without_op_record", F.lit(
            "a copy of a message of an earlier window that has no DELIVERED op record (rolled "
            "back, or its op record lost)"), message_id="outbox_id"),
        _finding(extra.join(explained, ["topic", "outbox_id"], "left_anti"),
                 "delivered_more_than_once",
                 F.format_string("a copy found after its window was judged; its DELIVERED op "
                                 "record is at %d/%d", _partition_of("op_at"),
                                 _offset_of("op_at")),
                 message_id="outbox_id"),
        _misplaced(wrong, records),
    ]


def _as_is(df: DataFrame) -> DataFrame:
    """No broadcast hint: a side that may hold millions of rows."""
    return df


def op_record_position_mismatch(facts: DataFrame, claims: DataFrame, records: DataFrame
                                ) -> DataFrame:
    """DELIVERED op records whose topic, partition and offset hold another record, or none.

    A message with one op record and at most one copy (nearly all) is compared on its two
    positions; the few in :func:`several` are checked claim by claim.
    """
    single = facts.where(
        (F.col("delivered_ops") == 1) & (F.col("kafka_copies") <= 1)
        & (F.col("op_at").isNull() | F.col("copy_at").isNull()
           | (F.col("op_at") != F.col("copy_at")))
    ).select("id", "topic", _partition_of("op_at").alias("partition"),
             _offset_of("op_at").alias("offset"))
    held = records.join(F.broadcast(claims.select("topic", F.col("id").alias("outbox_id"))),
                        ["topic", "outbox_id"], "left_semi").select(
        F.col("outbox_id").alias("id"), "topic", "partition", "offset")
    return _misplaced(single.unionByName(
        claims.join(held, ["id", "topic", "partition", "offset"], "left_anti")), records)


def _misplaced(wrong: DataFrame, records: DataFrame) -> DataFrame:
    """op_record_position_mismatch of the op records ``wrong`` (id, topic, partition,
    offset), each with what its position holds among ``records``."""
    there = records.select("topic", "partition", "offset", F.col("outbox_id").alias("found_id"))
    found = wrong.join(there, ["topic", "partition", "offset"], "left")
    return _finding(
        found, "op_record_position_mismatch",
        F.when(F.col("partition").isNull() | F.col("offset").isNull(),
               F.lit("DELIVERED op record without partition/offset"))
        .when(F.col("found_id").isNotNull(),
              F.format_string("the record there is message %d", "found_id"))
        .otherwise(F.lit("no record with an outbox-id at that position")))


def key_order_broken(facts: DataFrame, *, topics_read: bool,
                     anchors: DataFrame | None = None) -> DataFrame:
    """Within a (topic, key), positions must grow with message id, all in one partition.

    Positions are the first copy in Kafka when the topics are read, else the op records';
    later duplicates do not count (consumers deduplicate them on outbox-id). A message
    resumed by an operator (parked or discarded first) left its key's order, as documented
    (guarantees.md): it is sent after the later messages of its key, and is left out.
    ``anchors``,
    the last message of each key placed before this run, is where each key's check starts,
    so a reorder across two windows is found (and named by the message placed out of order).
    """
    at = F.col("copy_at") if topics_read else F.col("op_at")
    placed = facts.where(F.col("key").isNotNull() & at.isNotNull()
                         & (F.col("resumed_ops") == 0)).select(
        "id", "topic", "key", at.alias("at"), F.lit(False).alias("anchor"))
    by_key = Window.partitionBy("topic", "key").orderBy("id", "anchor")
    if anchors is not None:
        before = anchors.select("id", "topic", "key", (
            F.coalesce("copy_at", "op_at") if topics_read else F.col("op_at")).alias("at"),
            F.lit(True).alias("anchor"))
        # An anchor that is also a message of this run (a re-audited window) sorts right
        # after it and is dropped: done inside the window's sort, not by an anti-join that
        # shuffles every id of the window once more.
        placed = placed.unionByName(before.where(F.col("at").isNotNull())).select(
            "*", F.lag("id").over(by_key).alias("twin")
        ).where(F.col("twin").isNull() | (F.col("twin") != F.col("id"))).drop("twin")
    compared = placed.select(
        "*", F.lag("id").over(by_key).alias("prev_id"), F.lag("at").over(by_key).alias("prev"))
    broken = compared.where(
        F.col("prev_id").isNotNull()
        & ((_partition_of("at") != _partition_of("prev"))
           | (_offset_of("at") < _offset_of("prev"))))
    return _finding(
        broken, "key_order_broken",
        F.format_string("key %s: at %d/%d, but the earlier message %d is at %d/%d",
                        F.col("key").cast("string"), _partition_of("at"), _offset_of("at"),
                        "prev_id", _partition_of("prev"), _offset_of("prev")),
        position="at")


def stuck_unknown(cutoff: datetime) -> Rule:
    return Rule(
        "stuck_unknown",
        (F.col("resolution") == Resolution.UNKNOWN.value)
        & F.col("status").isin(Status.PENDING.value, Status.DELAYED.value)
        & (F.col("created_at") < F.lit(cutoff)),
        F.format_string("%d check-backs, created %s, next check %s", "check_count",
                        _ts("created_at"), F.coalesce(_ts("next_check_at"), F.lit("none"))))


def discarded() -> Rule:
    return Rule(
        "discarded", F.col("status") == Status.DISCARDED.value,
        F.concat(
            F.format_string("resolution %s after %d check-backs", "resolution", "check_count"),
            F.coalesce(F.concat(F.lit(", last error: "), "last_error"), F.lit(""))))


# --- statistics ------------------------------------------------------------------------------

PERCENTILES = (0.5, 0.9, 0.99)


#: What the statistics count messages by; the job counts them in the aggregation that also
#: gives its totals (one scan of the cached rows for both).
STATE = ("topic", "resolution", "status", "check_count")


def stats(states_counted: Iterable[Any], messages: DataFrame) -> dict[str, Any]:
    """Counts by topic and resolution, delivery latency percentiles, check-back histogram.

    ``states_counted``: rows of the :data:`STATE` columns and ``messages``, their count.
    """
    states: dict[tuple[str, str, str], int] = {}
    checks: dict[int, int] = {}
    for r in states_counted:
        key = (r.topic, r.resolution, r.status)
        states[key] = states.get(key, 0) + r.messages
        checks[r.check_count] = checks.get(r.check_count, 0) + r.messages
    counts = [{"topic": t, "resolution": res, "status": st, "count": n}
              for (t, res, st), n in sorted(states.items())]
    latency = (F.unix_micros("delivered_at") - F.unix_micros("created_at")) / 1e6
    delivered = messages.where(F.col("delivered_at").isNotNull()).select(
        "topic", latency.alias("seconds"))
    summary = [
        F.count(F.lit(1)).alias("delivered"),
        F.percentile_approx("seconds", list(PERCENTILES), 10_000).alias("percentiles"),
        F.max("seconds").alias("max"),
    ]
    latencies = [_latency(r, r.topic or "*") for r in delivered.rollup("topic").agg(*summary)
                 .orderBy(F.col("topic").isNull(), "topic").collect() if r.delivered]
    histogram = [{"check_count": c, "messages": n} for c, n in sorted(checks.items())]
    return {"counts": counts, "latency_seconds": latencies, "check_backs": histogram}


def _latency(row: Any, topic: str) -> dict[str, Any]:
    values = dict(zip((f"p{round(q * 100)}" for q in PERCENTILES), row.percentiles or (),
                      strict=False))
    return {"topic": topic, "delivered": row.delivered, **values, "max": row.max}
