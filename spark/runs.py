"""The reconcile_run table: one summary row per reconciliation run, written only by the job.

It is declared on the outbox's metadata (so the migrations create it with the other tables)
but lives here, with the job that owns it; the library applications import never loads it.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import BigInteger, Boolean, Column, DateTime, Identity, Table, Text, func
from sqlalchemy.dialects.postgresql import JSONB

from outbox.schema import metadata, one_of


class RunOutcome(StrEnum):
    """How a reconciliation run ended: no findings, findings within thresholds, or over one."""

    CLEAN = "CLEAN"
    FINDINGS = "FINDINGS"
    FAILED = "FAILED"


#: One summary row per reconciliation run; the newest is the next run's watermark.
reconcile_run = Table(
    "reconcile_run",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("window_since", DateTime(timezone=True)),
    Column("window_until", DateTime(timezone=True), nullable=False),
    Column("read_topics", Boolean, nullable=False),
    #: {topic: {partition: next offset}} read up to, when the run read the topics.
    Column("kafka_offsets", JSONB),
    Column("messages", BigInteger, nullable=False),
    Column("op_records", BigInteger, nullable=False),
    Column("kafka_records", BigInteger),
    #: {finding: count}
    Column("findings", JSONB, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("output_path", Text, nullable=False),
    one_of("outcome", RunOutcome),
)
