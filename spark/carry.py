"""What a run hands to the next, so nothing escapes because its window passed.

Each run writes two Parquet datasets and two small JSON files under its output folder, and
the next run reads those of the run that set the watermark (queries.watermark):

* ``carry/open``: the ids of the messages it judged that were still open (a pending row:
  PENDING, DELAYED, PARKED or DISCARDED, whatever the resolution). The next run reads them
  again beside its own window and judges them by the SLA at its own time, until they are
  delivered or rolled back; so a late delivery is still checked, and a message never
  delivered is reported by every run until it is.
* ``carry/keys``: per topic and key, the last message placed in Kafka (its id, its op record's
  position and, when the topics were read, its first copy's). The next run's per-key order
  check starts from it, so a reorder spanning two windows is found. Keys of earlier runs are
  kept until a later message of the key replaces them.
* ``carry/later.json``: per topic and partition, the lowest offset of the records a run
  that read the topics read of later windows' messages (it reads to the topics' end, past
  its own window), which it left to the runs that judge those windows. A run that reads the
  tables only hands on what it was handed; the next run that reads the topics after it
  compares those records with their op records (reconcile._read_topics).
* ``carry/heads.json``: per topic and partition, the offset and timestamp of the first record
  the last run that read the topics found there. A partition that begins earlier, or at the
  same offset with another record, was deleted and recreated: the next topic run reads it
  from its start (sources.recreated). Tables-only runs, and re-audits of older windows, hand
  on what they were handed.

A run whose predecessor left no carry (a run before this existed, or an output folder
removed) logs a warning; the tables then stand in for ``carry/open`` (queries.open_before),
and per-key order starts afresh.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from outbox.schema import Status

log = logging.getLogger("outbox.reconcile")
OPEN = "carry/open"
KEYS = "carry/keys"
LATER = "carry/later.json"
HEADS = "carry/heads.json"
OPEN_SCHEMA = "id long"
KEYS_SCHEMA = "topic string, key binary, id long, op_at long, copy_at long"
#: A message with one of these has reached its end; any other status is still open.
SETTLED = (Status.DELIVERED.value, Status.ROLLED_BACK.value)


@dataclass(frozen=True)
class Carry:
    """What the previous run handed over; ``keys`` is None when it handed nothing."""

    open_ids: list[int]
    keys: DataFrame | None
    #: The previous run's carry was not found where it wrote it.
    missing: bool = False
    #: {(topic, partition): offset} where the records of later windows' messages begin.
    later: dict[tuple[str, int], int] = field(default_factory=dict)
    #: {(topic, partition): (offset, timestamp in ms)} of the first records last seen.
    heads: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)


def read(spark: SparkSession, previous_output: str | None) -> Carry:
    """The carry of the run whose output is ``previous_output`` (None: the first run)."""
    if previous_output is None:
        return Carry([], None)
    base = Path(previous_output)
    if not (base / OPEN).is_dir() or not (base / KEYS).is_dir():
        return Carry([], None, missing=True)
    ids = [r.id for r in spark.read.schema(OPEN_SCHEMA).parquet(str(base / OPEN)).collect()]
    later = {key: offset for key, (offset,) in _read_partitions(base / LATER).items()}
    heads = {key: (offset, at) for key, (offset, at) in _read_partitions(base / HEADS).items()}
    return Carry(sorted(ids), spark.read.schema(KEYS_SCHEMA).parquet(str(base / KEYS)),
                 later=later, heads=heads)


def _read_partitions(path: Path) -> dict[tuple[str, int], list[int]]:
    """A JSON file of ``[topic, partition, *numbers]`` rows; none from an older release."""
    if not path.is_file():
        return {}
    return {(topic, partition): numbers
            for topic, partition, *numbers in json.loads(path.read_text())}


def _write_partitions(path: Path, rows: Mapping[tuple[str, int], tuple[int, ...]]) -> None:
    # a few numbers: JSON, not a Parquet job (0.2 s a warm run, 0.9 s a cold one)
    path.write_text(json.dumps(sorted([t, p, *numbers] for (t, p), numbers in rows.items())))


def still_open(facts: DataFrame) -> DataFrame:
    """The judged messages that have not reached their end: the next run judges them again.

    UNACCOUNTED rows (state deleted by something else) never change again: not carried.
    """
    return facts.where(~F.col("status").isin(*SETTLED, "UNACCOUNTED")).select("id")


def last_by_key(facts: DataFrame, anchors: DataFrame | None) -> DataFrame:
    """Per (topic, key), the placed message with the highest id, of this run or earlier."""
    placed = facts.where(
        F.col("key").isNotNull() & (F.col("op_at").isNotNull() | F.col("copy_at").isNotNull())
    ).select("topic", "key", "id", "op_at", "copy_at")
    every = placed if anchors is None else placed.unionByName(anchors)
    # One max_by per long column, not one of a struct: a struct buffer is not hash-aggregable,
    # so Spark sorted every placed message of the window for this.
    return every.groupBy("topic", "key").agg(
        F.max("id").alias("id"), F.max_by("op_at", "id").alias("op_at"),
        F.max_by("copy_at", "id").alias("copy_at"))


def write(spark: SparkSession, output: Path, facts: DataFrame, anchors: DataFrame | None,
          later: dict[tuple[str, int], int],
          heads: dict[tuple[str, int], tuple[int, int]]) -> int:
    """Write this run's carry; returns how many messages it carries over."""
    still_open(facts).coalesce(1).write.mode("error").parquet(str(output / OPEN))
    last_by_key(facts, anchors).write.mode("error").parquet(str(output / KEYS))
    _write_partitions(output / LATER, {key: (offset,) for key, offset in later.items()})
    _write_partitions(output / HEADS, heads)
    # Counted by reading them back, a job of its own, not by an Observation as they are
    # written: a window with nothing open can have its CollectMetrics optimised away as an
    # empty relation, and Observation.get then waits forever (SPARK-54620).
    return spark.read.schema(OPEN_SCHEMA).parquet(str(output / OPEN)).count()
