"""Every SQL statement of the reconciliation: JDBC subqueries, window bounds, run summaries.

Statements are built with SQLAlchemy Core from ``outbox.schema``, so table and column names
have one source. The JDBC subqueries are rendered to text with literal values; only typed
Python values (datetimes, integers) are rendered, and the schema is a validated identifier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Dialect, Table
from sqlalchemy.dialects import postgresql

from outbox import schema as outbox_schema
from outbox.schema import Action, Resolution, Status
from outbox.settings import validate_identifier
from outbox.spark import runs

#: The status of a message that has neither a pending row nor a DELIVERED or ROLLED_BACK op
#: record: its state was deleted by something other than the outbox.
UNACCOUNTED = "UNACCOUNTED"
#: Message ids sent per ``= ANY(...)`` lookup.
LOOKUP_CHUNK = 10_000
_POSTGRESQL: Dialect = postgresql.dialect()  # type: ignore[no-untyped-call]

_activity = sa.table(
    "pg_stat_activity",
    sa.column("pid"),
    sa.column("datname"),
    sa.column("backend_type"),
    sa.column("xact_start"),
    schema="pg_catalog",
)


@dataclass(frozen=True)
class Tables:
    """The outbox tables as they live in one schema."""

    message: Table
    pending: Table
    op_record: Table
    reconcile_run: Table


@cache
def tables(schema: str) -> Tables:
    copy = sa.MetaData()
    name = validate_identifier(schema)
    return Tables(
        message=outbox_schema.message.to_metadata(copy, schema=name),
        pending=outbox_schema.pending.to_metadata(copy, schema=name),
        op_record=outbox_schema.op_record.to_metadata(copy, schema=name),
        reconcile_run=runs.reconcile_run.to_metadata(copy, schema=name),
    )


@dataclass(frozen=True)
class Window:
    """Messages created in ``[since, until)``; ``since`` None means from the beginning."""

    since: datetime | None
    until: datetime


def _in_window(column: sa.ColumnElement[Any], window: Window) -> sa.ColumnElement[bool]:
    upper = column < window.until
    return upper if window.since is None else sa.and_(column >= window.since, upper)


def as_subquery(statement: sa.Select[Any], alias: str) -> str:
    """A JDBC ``dbtable`` value: the statement with its values rendered as literals."""
    compiled = statement.compile(dialect=_POSTGRESQL, compile_kwargs={"literal_binds": True})
    return f"({compiled}) AS {validate_identifier(alias, 'alias')}"


# --- the window ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """The database's now, and the window end no still-open transaction can write before."""

    now: datetime
    until: datetime
    requested_until: datetime


def window_end(conn: Connection, requested: datetime | None, sla_seconds: float) -> Clock:
    """Clamp the window's end to the start of the oldest open transaction.

    A prepare row's created_at is its transaction's start, so no row older than the oldest
    open transaction can still commit: a window ending there never skips a late commit.
    """
    oldest_open = (
        sa.select(sa.func.min(_activity.c.xact_start))
        .where(
            _activity.c.datname == sa.func.current_database(),
            _activity.c.backend_type == "client backend",
            _activity.c.pid != sa.func.pg_backend_pid(),
        )
        .scalar_subquery()
    )
    wanted = (
        sa.cast(sa.literal(requested), sa.DateTime(timezone=True)) if requested is not None
        else sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, sla_seconds)
    )
    row = conn.execute(sa.select(
        sa.func.now().label("now"),
        wanted.label("requested"),
        sa.func.least(wanted, oldest_open).label("until"),
    )).one()
    return Clock(now=row.now, until=row.until, requested_until=row.requested)


@dataclass(frozen=True)
class Bounds:
    """How many messages a window holds and their id range (for partitioned reads)."""

    count: int
    min_id: int | None
    max_id: int | None


def window_bounds(conn: Connection, schema: str, window: Window) -> Bounds:
    """Counted here so the reads can be cut into even id ranges before Spark starts."""
    message = tables(schema).message
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.min(message.c.id), sa.func.max(message.c.id))
        .where(_in_window(message.c.created_at, window))
    ).one()
    return Bounds(count=int(row[0]), min_id=row[1], max_id=row[2])


# --- JDBC subqueries -------------------------------------------------------------------------


#: A Kafka position (partition, offset) travels as one bigint: partition << 40 | offset.
POSITION_OFFSET_BITS = 40


def _position(partition: sa.ColumnElement[Any], offset: sa.ColumnElement[Any]
              ) -> sa.ColumnElement[Any]:
    return sa.cast(partition, sa.BigInteger).op("<<")(POSITION_OFFSET_BITS).op("|")(offset)


def message_facts(schema: str, window: Window, ids: tuple[int, int]) -> str:
    """The window's prepare rows with ids in ``ids`` (see :func:`_facts`)."""
    m, o = tables(schema).message, tables(schema).op_record
    return _facts(schema, sa.and_(_in_window(m.c.created_at, window), m.c.id.between(*ids)),
                  o.c.message_id.between(*ids))


def carried_facts(schema: str, window: Window, ids: list[int]) -> str:
    """The prepare rows ``ids`` carried over from earlier runs (open when the last run read
    them), those created before the window (later ones are the window's own)."""
    m, o = tables(schema).message, tables(schema).op_record
    before = m.c.created_at < window.since if window.since is not None else sa.false()
    return _facts(schema, sa.and_(m.c.id.in_(ids), before), o.c.message_id.in_(ids))


def _facts(schema: str, messages: sa.ColumnElement[bool], ops_of: sa.ColumnElement[bool]
           ) -> str:
    """Prepare rows (no payloads), each with its state and its op records summed up: how
    many, how many DELIVERED and RESUMED, the first DELIVERED position.

    A row's state is its pending row while it has one, else its op records say how it
    ended (DELIVERED, or ROLLED_BACK); a row with neither is UNACCOUNTED, which no path of
    the outbox leaves behind. PostgreSQL merges the index range scans (message and pending by
    id, op_record by message_id), so Spark reads one row per message and joins nothing.
    ``ops_of`` bounds the op records summed up to those of the rows ``messages`` selects.
    """
    t = tables(schema)
    m, p, o = t.message, t.pending, t.op_record
    delivered = o.c.action == Action.DELIVERED.value
    rolled_back = o.c.action == Action.ROLLED_BACK.value
    ops = (
        sa.select(
            o.c.message_id,
            sa.func.count().label("op_records"),
            sa.func.count().filter(delivered).label("delivered_ops"),
            sa.func.count().filter(rolled_back).label("rolled_back_ops"),
            sa.func.count().filter(o.c.action == Action.RESUMED.value).label("resumed_ops"),
            sa.func.min(_position(o.c.kafka_partition, o.c.kafka_offset)).filter(delivered)
            .label("op_at"),
            sa.func.min(o.c.created_at).filter(delivered).label("delivered_at"),
        )
        .where(ops_of)
        .group_by(o.c.message_id)
        .subquery("ops")
    )
    ended_delivered = sa.func.coalesce(ops.c.delivered_ops, 0) > 0
    ended_rolled_back = sa.func.coalesce(ops.c.rolled_back_ops, 0) > 0
    status = sa.func.coalesce(p.c.status, sa.case(
        (ended_rolled_back, Status.ROLLED_BACK.value),
        (ended_delivered, Status.DELIVERED.value),
        else_=UNACCOUNTED))
    resolution = sa.func.coalesce(p.c.resolution, sa.case(
        (ended_rolled_back, Resolution.ROLLBACK.value), else_=Resolution.COMMIT.value))
    return as_subquery(
        sa.select(
            m.c.id, m.c.topic, m.c.key, resolution.label("resolution"),
            status.label("status"),
            sa.func.coalesce(p.c.check_count, 0).label("check_count"),
            p.c.next_check_at, m.c.deliver_after,
            sa.func.coalesce(p.c.attempts, 0).label("attempts"), p.c.last_error,
            m.c.created_at, ops.c.delivered_at,
            sa.func.coalesce(ops.c.op_records, 0).label("op_records"),
            sa.func.coalesce(ops.c.delivered_ops, 0).label("delivered_ops"),
            sa.func.coalesce(ops.c.resumed_ops, 0).label("resumed_ops"),
            ops.c.op_at,
        )
        .select_from(m.outerjoin(p, p.c.message_id == m.c.id)
                     .outerjoin(ops, ops.c.message_id == m.c.id))
        .where(messages),
        "m",
    )


def open_before(conn: Connection, schema: str, since: datetime) -> list[int]:
    """Messages created before ``since`` that were open then as far as the tables still
    tell: a pending row now, or an op record written since (what a run's carry holds, when
    the last run's is lost)."""
    t = tables(schema)
    m, p, o = t.message, t.pending, t.op_record
    still = sa.select(p.c.message_id.label("id")).where(p.c.created_at < since)
    settled_since = sa.select(o.c.message_id.label("id")).select_from(
        o.join(m, m.c.id == o.c.message_id)).where(o.c.created_at >= since,
                                                   m.c.created_at < since)
    return sorted(conn.execute(sa.union(still, settled_since)).scalars())


def origins_between(schema: str, ids: tuple[int, int], window: Window,
                    unread: Window | None) -> str:
    """:func:`_origins` of the messages with ids in ``ids``, as a JDBC subquery."""
    m = tables(schema).message
    return as_subquery(_origins(schema, window, unread).where(m.c.id.between(*ids)), "origin")


def origins_of(conn: Connection, schema: str, ids: Iterable[int], window: Window,
               unread: Window | None) -> list[Any]:
    """:func:`_origins` of the messages ``ids``, from the driver (a few: see
    reconcile._outside)."""
    m = tables(schema).message
    return _chunked(conn, ids, lambda chunk: _origins(schema, window, unread).where(
        m.c.id == sa.any_(chunk)))


def _origins(schema: str, window: Window, unread: Window | None) -> sa.Select[Any]:
    """Prepare rows, for the Kafka records outside the window: (id, topic, ``earlier``: of
    an earlier window, or else of a later one, ``unread``: of a window only tables-only runs
    judged)."""
    m = tables(schema).message
    judged_unread = sa.false() if unread is None else _in_window(m.c.created_at, unread)
    return sa.select(m.c.id, m.c.topic, (m.c.created_at < window.until).label("earlier"),
                     judged_unread.label("unread"))


def delivered_between(schema: str, ids: tuple[int, int]) -> str:
    """:func:`_delivered` of the messages with ids in ``ids``, as a JDBC subquery."""
    o = tables(schema).op_record
    return as_subquery(_delivered(schema).where(o.c.message_id.between(*ids)), "claim")


def delivered_positions(conn: Connection, schema: str, ids: Iterable[int]) -> list[Any]:
    """:func:`_delivered` of the messages ``ids``, from the driver: the few messages
    delivered more than once, checked record by record, and those of few records outside
    the window."""
    o = tables(schema).op_record
    return _chunked(conn, ids, lambda chunk: _delivered(schema).where(
        o.c.message_id == sa.any_(chunk)))


def _delivered(schema: str) -> sa.Select[Any]:
    """(id, topic, partition, offset) of DELIVERED op records."""
    t = tables(schema)
    m, o = t.message, t.op_record
    return (sa.select(o.c.message_id.label("id"), m.c.topic,
                      o.c.kafka_partition.label("partition"), o.c.kafka_offset.label("offset"))
            .select_from(o.join(m, m.c.id == o.c.message_id))
            .where(o.c.action == Action.DELIVERED.value))


def _chunked(conn: Connection, ids: Iterable[int],
             select: Callable[[sa.BindParameter[Any]], sa.Select[Any]]) -> list[Any]:
    """The rows of ``select(chunk)`` for ``ids`` in chunks of LOOKUP_CHUNK, each an array."""
    wanted = sorted(set(ids))
    return [tuple(row) for start in range(0, len(wanted), LOOKUP_CHUNK)
            for row in conn.execute(select(sa.literal(
                wanted[start:start + LOOKUP_CHUNK], sa.ARRAY(sa.BigInteger))))]


def op_record_bounds(conn: Connection, schema: str, window: Window) -> tuple[int, int] | None:
    """The id range of op records written in the window (None when there are none)."""
    o = tables(schema).op_record
    row = conn.execute(sa.select(sa.func.min(o.c.id), sa.func.max(o.c.id))
                       .where(_in_window(o.c.created_at, window))).one()
    return None if row[0] is None else (int(row[0]), int(row[1]))


def orphan_op_records(schema: str, window: Window, ids: tuple[int, int]) -> str:
    """Op records written in the window for the message ids in ``ids``, whose prepare row is
    missing: a merge anti-join of the two id-ordered indexes, each read over ``ids`` alone
    (so hashing or reading every message id of the history is impossible). Cut by the same
    message id ranges as :func:`message_facts`; :func:`outlying_orphan_op_records` covers
    the message ids outside the window's."""
    o, m = tables(schema).op_record, tables(schema).message
    return _orphans(schema, window, o.c.message_id.between(*ids),
                    sa.select(sa.literal(1)).where(m.c.id == o.c.message_id,
                                                   m.c.id.between(*ids)))


def outlying_orphan_op_records(schema: str, window: Window, ids: tuple[int, int],
                               message_ids: tuple[int, int]) -> str:
    """Op records written in the window, with ids in ``ids``, for a message id outside
    ``message_ids`` (the window's), whose prepare row is missing: the few such records (a
    message of an earlier window delivered late) are each a primary-key probe. ``OFFSET 0``
    keeps the NOT EXISTS a probe: pulled up into an anti-join, PostgreSQL may hash every
    message id of the history."""
    o, m = tables(schema).op_record, tables(schema).message
    low, high = message_ids
    return _orphans(schema, window, sa.and_(
        o.c.id.between(*ids), sa.or_(o.c.message_id < low, o.c.message_id > high)),
        sa.select(sa.literal(1)).where(m.c.id == o.c.message_id).offset(0))


def _orphans(schema: str, window: Window, which: sa.ColumnElement[bool],
             message_of: sa.Select[Any]) -> str:
    o = tables(schema).op_record
    return as_subquery(
        sa.select(
            o.c.id, o.c.message_id, o.c.action, o.c.actor, o.c.kafka_partition,
            o.c.kafka_offset, o.c.created_at,
        ).where(_in_window(o.c.created_at, window), which, ~sa.exists(message_of)),
        "orphan",
    )


def pruned_below(conn: Connection, schema: str) -> int | None:
    """The lowest id of the ranges of ``message`` kept (retention dropped the ranges below
    it, oldest first): a lower id without a prepare row was pruned. None when the lowest
    range is open below."""
    name = validate_identifier(schema, "schema")
    bounds = getattr(sa.func, name).partition_bounds(f"{name}.message").table_valued(
        "name", "low", "high")
    lowest, unbounded = conn.execute(sa.select(
        sa.func.min(bounds.c.low), sa.func.bool_or(bounds.c.low.is_(None)))).one()
    return None if unbounded or lowest is None else int(lowest)


# --- run summaries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Watermark:
    """Where the previous runs stopped: the newest window end, the Kafka offsets read and
    the newest window end of the runs that read them, and the output of the latest run
    that reached that end (it holds what it carries over)."""

    until: datetime | None
    kafka_offsets: dict[str, dict[str, int]] | None
    output_path: str | None = None
    #: The newest window end of the runs that read the topics, but for re-audits of a
    #: window before the last run's end (None: no run read them).
    topics_until: datetime | None = None


def watermark(conn: Connection, schema: str) -> Watermark:
    """The latest window end (a re-audit of an old window never moves it back)."""
    run = tables(schema).reconcile_run
    last = conn.execute(
        sa.select(run.c.window_until, run.c.output_path)
        .order_by(run.c.window_until.desc(), run.c.id.desc()).limit(1)
    ).one_or_none()
    # Runs that read no topic store JSON null: they say nothing about where Kafka was read.
    offsets = conn.execute(
        sa.select(run.c.kafka_offsets).where(run.c.read_topics)
        .order_by(run.c.id.desc()).limit(1)
    ).scalar_one_or_none()
    # of the topic runs that moved the window end on: a re-audit of an older window keeps
    # the last one's offsets (reconcile._next_start), and judged only its own window
    earlier = run.alias("earlier")
    topics_until = conn.execute(
        sa.select(sa.func.max(run.c.window_until)).where(run.c.read_topics, ~sa.exists(
            sa.select(sa.literal(1)).where(earlier.c.id < run.c.id,
                                           earlier.c.window_until > run.c.window_until)))
    ).scalar_one()
    if last is None:
        return Watermark(until=None, kafka_offsets=offsets)
    return Watermark(until=last.window_until, kafka_offsets=offsets,
                     output_path=last.output_path, topics_until=topics_until)


def topics_of(conn: Connection, schema: str, window: Window) -> set[str]:
    """The topics of the messages created in ``window``."""
    message = tables(schema).message
    return set(conn.execute(sa.select(message.c.topic).distinct()
                            .where(_in_window(message.c.created_at, window))).scalars())


def record_run(conn: Connection, schema: str, values: dict[str, Any]) -> int:
    """Insert a run's summary row; returns its id."""
    run = tables(schema).reconcile_run
    return int(conn.execute(sa.insert(run).values(**values).returning(run.c.id)).scalar_one())
