"""The reconcile_run table: one summary row per reconciliation run, written only by the job;
and the lock that keeps runs of one schema from overlapping.

It is declared on the outbox's metadata (so the migrations create it with the other tables)
but lives here, with the job that owns it; the library applications import never loads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Engine,
    Identity,
    Table,
    Text,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB

from outbox.exceptions import ConfigurationError, OutboxError
from outbox.schema import metadata, one_of
from outbox.settings import validate_identifier

#: Namespace of the advisory lock that lets one reconciliation run of a schema at a time
#: (first half of the lock key; outbox/store.py's locks use 0x0B0C to 0x0B0E and 0x0B10).
RUN_LOCK_CLASS = 0x0B1C


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
    #: {topic: {partition: next offset}} where the next run reading the topics starts: read
    #: up to, when the run read them (a re-audit of an older window keeps the last ones).
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


class RunInProgress(OutboxError):
    """Another reconciliation run of the same schema is under way; this one did nothing."""


@contextlib.contextmanager
def one_at_a_time(engine: Engine, schema: str) -> Iterator[None]:
    """Hold the schema's run lock for the block, or raise RunInProgress at once.

    Two runs at once would read the same watermark and reconcile overlapping windows. The
    lock is a session lock on a connection of its own, idle while the run works (so it never
    holds back the window end), released at the end, or by the server when the process dies.
    """
    lock = (RUN_LOCK_CLASS, func.hashtext(validate_identifier(schema)))
    with engine.connect() as conn:
        taken = conn.execute(select(func.pg_try_advisory_lock(*lock))).scalar_one()
        conn.commit()
        if not taken:
            raise RunInProgress(
                f"another reconciliation run of schema {schema!r} is in progress; this one "
                "did nothing (runs of a schema take turns: start the next when it ends)")
        try:
            yield
        finally:
            conn.execute(select(func.pg_advisory_unlock(*lock)))
            conn.commit()


def require_recording(conn: Connection, schema: str) -> None:
    """Refuse a role that may not record its run: found only at the run's end, after the
    whole job, with its report unprinted."""
    role, may = conn.execute(select(
        literal_column("current_user"),
        func.has_table_privilege(f"{schema}.reconcile_run", "INSERT"))).one()
    if not may:
        raise ConfigurationError(
            f"role {role} may not record a run in {schema}.reconcile_run (INSERT): run as a "
            "member of the <schema>_reconcile role (`outbox db upgrade --create-roles`)")


def require_hold_back(conn: Connection) -> None:
    """Refuse a role that cannot hold the window end back.

    The window ends before the oldest open transaction, read from pg_stat_activity, which
    shows other roles' transactions only to superusers and members of pg_read_all_stats:
    without it, a transaction committing late could fall behind a window already passed.
    """
    role, sees_all = conn.execute(select(
        literal_column("current_user"), func.pg_has_role("pg_read_all_stats", "USAGE"))).one()
    if not sees_all:
        raise ConfigurationError(
            f"role {role} cannot see other sessions' transactions, so a late commit could "
            f"escape reconciliation: GRANT pg_read_all_stats TO {role}, or run as a member of "
            "the <schema>_reconcile role (`outbox db upgrade --create-roles`)")
