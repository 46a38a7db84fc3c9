"""The only module that speaks the outbox's SQL (``sql/queries.sql``).

Each function takes a SQLAlchemy ``Connection`` (or returns a statement for the caller's
session to run; the relay's LISTEN connection, in ``fall_asleep`` and ``rise``, is psycopg's
own), so the library, the relay and the CLI share one set of queries.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import time
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache, partial
from importlib import resources
from typing import Any, NamedTuple

import psycopg
from psycopg import sql
from sqlalchemy import Connection, Engine, TextClause, create_engine, event, make_url, text
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.exc import DBAPIError

from outbox.encoding import EncodedMessage, ascii_digits
from outbox.exceptions import (
    INSUFFICIENT_PRIVILEGE,
    LOCK_WAIT_SECONDS,
    CheckerRefused,
    first_line,
    server_trouble,
    sqlstate,
)
from outbox.message import Message
from outbox.schema import Resolution
from outbox.settings import RELAY_BATCH_BYTES, validate_identifier

log = logging.getLogger(__name__)

#: Namespace of the advisory locks that order writers of one key (first half of the lock key).
LOCK_CLASS = 0x0B0C
#: Namespace of the advisory locks that keep a relay's worker id to one live process.
WORKER_LOCK_CLASS = 0x0B0D
#: Namespace of the advisory lock that serialises migrations of one schema.
MIGRATION_LOCK_CLASS = 0x0B0E
#: Namespace of the advisory locks a sleeping relay holds on its shards (``wake_base``).
WAKE_LOCK_CLASS = 0x0B10
#: The NOTIFY payload of a commit whose row is due later (the relay then re-reads when the
#: next delayed row is due); other commits notify with an empty payload.
DELAYED_NOTE = "delayed"
#: Range partitions of ``message`` and ``op_record`` kept ready beyond the id sequence.
PARTITIONS_AHEAD = 2
_BLOCK = re.compile(r"^-- name: (\w+)\n", re.MULTILINE)
_COMMENTS = re.compile(r"\A(?:--[^\n]*\n)+")
_INCLUDE = re.compile(r"\{(\w+)\}")


@cache
def _raw_queries() -> dict[str, str]:
    """queries.sql's blocks by name; ``{name}`` in a block is the block ``name``'s text,
    without its comments and final semicolon (one place for SQL two queries share)."""
    source = resources.files("outbox").joinpath("sql/queries.sql").read_text()
    parts = _BLOCK.split(source)[1:]
    blocks = {name: body.strip() for name, body in zip(parts[::2], parts[1::2], strict=True)}

    def expanded(name: str) -> str:
        return _INCLUDE.sub(lambda m: _COMMENTS.sub("", expanded(m[1])).removesuffix(";")
                            if m[1] in blocks else m[0], blocks[name])

    return {name: expanded(name) for name in blocks}


@cache
def query(name: str, schema: str) -> TextClause:
    """The named query, bound to ``schema`` (a validated identifier, never raw input)."""
    return text(_raw_queries()[name].replace("{schema}", validate_identifier(schema)))


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which commits of new prepare rows are announced."""
    return f"{validate_identifier(schema)}_pending"


@cache
def wake_base(schema: str) -> int:
    """The first of the schema's 64 wake lock keys (shard ``s`` is ``wake_base + s``)."""
    return zlib.crc32(validate_identifier(schema).encode()) & 0x3FFF_FFC0


def publish(
    schema: str,
    message: EncodedMessage,
    *,
    producer_group: str = "default",
    resolution: Resolution = Resolution.COMMIT,
    deliver_at: datetime | None = None,
    delay_seconds: float = 0.0,
    check_after_seconds: float | None = None,
    notify: bool = True,
) -> tuple[TextClause, dict[str, Any]]:
    """The statement and parameters that write one prepare row (run by the caller).

    ``deliver_at`` or ``delay_seconds`` (from the database's now) holds a message back;
    ``check_after_seconds`` is when an UNKNOWN row is first checked back; ``notify`` wakes
    a relay sleeping on the row's shard at commit (PostgreSQL serialises committing
    transactions that NOTIFY, so rows a relay is awake for do not).
    """
    return query("publish", schema), {
        "producer_group": producer_group,
        "topic": message.topic,
        "key": message.key,
        "header_keys": message.header_keys,
        "header_values": message.header_values,
        "payload": message.payload,
        "content_type": message.content_type,
        "resolution": resolution.value,
        "shard": message.shard,
        "check_after_seconds": check_after_seconds,
        "deliver_at": deliver_at,
        "delay_seconds": delay_seconds,
        "lock_class": LOCK_CLASS,
        "lock_key": message.lock_key,
        "channel": notify_channel(schema),
        "notify": notify,
        "delayed_note": DELAYED_NOTE,
        "wake_class": WAKE_LOCK_CLASS,
        "wake_base": wake_base(schema),
    }


class Deliverable(NamedTuple):
    """A committed prepare row as the relay sends it (a plain tuple: the relay reads
    thousands a second, so building it must cost next to nothing)."""

    id: int
    topic: str
    key: bytes | None
    header_keys: list[str] | None
    header_values: list[bytes] | None
    payload: bytes
    content_type: str

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return paired_headers(self.header_keys, self.header_values)


class UnpairedHeaders(ValueError):
    """A stored row's header names and values do not pair up: ``publish_message()`` refuses
    such rows since revision 0018, but a row it stored before may still be there."""


def paired_headers(names: list[str] | None, values: list[bytes] | None
                   ) -> list[tuple[str, bytes]]:
    """A stored row's headers as ``(name, value)`` pairs; raises :class:`UnpairedHeaders` when
    the arrays do not pair up one name to one value, none of them NULL (nor an array)."""
    names, values = names or [], values or []
    if len(names) != len(values) or not all(type(name) is str for name in names) \
            or not all(type(value) is bytes for value in values):
        raise UnpairedHeaders(
            f"its {len(names)} header names and {len(values)} header values do not pair up "
            "one to one, none of them NULL (a row stored before revision 0018)")
    return list(zip(names, values, strict=True))


#: What every session of the outbox's own sets aside of its role's defaults (:func:`engine`
#: on each new connection, the relay's wake-up connection, reconciliation's reads): none of
#: the timeouts a DBA may set on a role. The outbox bounds its own (a check-back by
#: ``checker_timeout``, the lock waits of migrations, retention and falling asleep).
#:
#: * ``statement_timeout`` would cancel the statements that grow with the work in hand (a
#:   batch's fetch and recording, a takeover's read of a backlog, retention's drop):
#:   retried, they would fail alike for ever. First, so it cannot cancel the SETs after it.
#: * ``idle_session_timeout`` would end the sessions that are idle by design (a relay's
#:   LISTEN and worker-id lock connections, pooled ones between batches): each quiet spell
#:   would be an outage.
#: * ``idle_in_transaction_session_timeout`` would end a check's session while its checker
#:   works (the check's transaction is open around it): every check of the message failed,
#:   and a committed message was discarded after 15.
#: * ``lock_timeout`` would make a relay's wait behind a migration's or retention's lock an
#:   outage, and its pass start again.
#: * ``transaction_timeout`` (PostgreSQL 17) would end what ``statement_timeout`` cancels,
#:   and the sessions with it; set only where the server knows it (:func:`settings_sql`).
#:
#: Nor the defaults that change what a statement means or how its answer reads:
#:
#: * ``DateStyle`` other than ISO: psycopg reads no other timestamps, and the sweeper's
#:   claims, a takeover's tail read, ``outbox discarded`` and the console failed on them;
#:   ``IntervalStyle`` likewise for intervals.
#: * ``standard_conforming_strings = off``: the backslashes of the functions' patterns
#:   (``partition_bounds``) became escapes, and every fetch, retention pass and upgrade
#:   failed.
#: * ``default_transaction_isolation`` above READ COMMITTED: the daemons took part in
#:   serializable conflict checks, failed passes as outages, and made applications' own
#:   transactions fail. (``default_transaction_read_only`` is kept: it is how a DBA freezes
#:   a database's writes, and how a failover's standby reads until it is promoted.)
#:
#: ``search_path`` is kept: the sweeper's checkers read the application's tables by their
#: names alone.
#:
#: The client encoding is a connection parameter (:data:`CONNECT_ARGS`): SQLAlchemy reads
#: the server's version before any SET.
SET_ASIDE_SETTINGS = {"statement_timeout": "0", "idle_session_timeout": "0",
                    "idle_in_transaction_session_timeout": "0", "lock_timeout": "0",
                    "transaction_timeout": "0",
                    "DateStyle": "ISO, MDY", "IntervalStyle": "postgres",
                    "standard_conforming_strings": "on",
                    "default_transaction_isolation": "read committed",
                    "default_transaction_deferrable": "off"}
#: Each connection of the outbox's own in UTF-8, whatever the role's ``client_encoding``:
#: LATIN1 could not carry a header name an application wrote (the relay paused for ever on
#: it), and SQL_ASCII made psycopg hand SQLAlchemy bytes for text at the first connect.
CONNECT_ARGS = {"client_encoding": "UTF8"}
SESSION_SETTINGS = {**SET_ASIDE_SETTINGS, "jit": "off", "plan_cache_mode": "force_custom_plan"}
#: A short command's sessions and retention's (``outbox prune``, the relay's pruner): their
#: waits for a lock are bounded (:data:`~outbox.exceptions.LOCK_WAIT_SECONDS`). Retention's
#: steps that lock a partition exclusively set shorter waits of their own.
SHORT_SESSION_SETTINGS = {**SESSION_SETTINGS, "lock_timeout": f"{LOCK_WAIT_SECONDS}s"}
DELIVERY_SETTINGS = {**SESSION_SETTINGS, "enable_sort": "off"}
#: The relay's fetching connection: the fetch, planned once (see
#: :func:`fetch_deliverable`).
FETCHING_SETTINGS = {**DELIVERY_SETTINGS, "plan_cache_mode": "force_generic_plan"}
RECORDING_SETTINGS = {**SESSION_SETTINGS, "enable_seqscan": "off",
                      "plan_cache_mode": "force_generic_plan"}


def engine(url: str, *, settings: Mapping[str, str] = SESSION_SETTINGS, **options: Any
           ) -> Engine:
    """An engine for the outbox's own processes (relay, sweeper, retention, console, CLI),
    whose sessions plan every statement for its parameters (all but the relay's recording
    and fetching connections, below) and never JIT-compile:

    * ``plan_cache_mode = force_custom_plan``: psycopg prepares a statement on its fifth run,
      and five runs later PostgreSQL may switch to a generic plan. The relay's generic fetch
      plan could neither hash its in-flight ids (a parameter, not a constant) nor walk the
      pending index to its LIMIT: it compared every pending row with every id in flight,
      1.5 s a batch at a 50,000-message backlog, and the relay fell from 20k to 2k msg/s
      after its eleventh batch. A custom plan costs well under a millisecond here.
    * ``jit = off``: the planner prices a lookup into partitioned ``message`` as if it visited
      every partition, so past ``jit_above_cost`` PostgreSQL compiled the fetch for 1.3 s
      (43 partitions) to run it in 9 ms.

    The relay's three hot connections plan for a queue (``settings``). ``pending``'s statistics
    are a snapshot: analyzed while nearly empty, then refilled in the space its vacuum freed,
    it looks to the planner like a few rows, and each batch read the whole backlog:

    * ``enable_sort = off`` for the delivery and fetching connections
      (:data:`DELIVERY_SETTINGS`, :data:`FETCHING_SETTINGS`): the fetch must walk pending's
      index in id order and stop at its LIMIT, the one plan without a sort; the planner
      sorted the whole backlog instead (a merge anti-join, or a sequential scan), so the
      longer the backlog, the slower each batch. The fetching connection plans the fetch
      once (:func:`fetch_deliverable`).
    * ``enable_seqscan = off`` for the recording connection (:data:`RECORDING_SETTINGS`): it
      closes a batch's rows by key, and the planner scanned every pending row to find them.
      Its two statements (``mark_delivered``, ``record_failures``) read by key whatever
      their parameters, so it plans each once (``force_generic_plan``): planning them for
      every batch cost more server time than running them, 120-154 µs against 101-158
      (BENCHMARKS.md, "Latency, session 17").

    SETs after connecting rather than startup options, which connection poolers such as
    PgBouncer refuse; before SQLAlchemy's own first statements (its look at the server's
    types), which a ``statement_timeout`` of a millisecond in the URL cancelled."""
    connect_args = {**options.pop("connect_args", {}), **CONNECT_ARGS}
    made = create_engine(url, connect_args=connect_args, **options)
    event.listen(made, "connect", partial(_session_settings, settings), insert=True)
    return made


#: SQLAlchemy's psycopg dialect: how the engines read a URL and render a statement.
_DIALECT = psycopg_dialect()  # type: ignore[no-untyped-call]


def connect(url: str, **options: Any) -> psycopg.Connection[Any]:
    """A psycopg connection of the outbox's own, outside any pool, made from ``url`` (a
    SQLAlchemy URL) as the engines make theirs: a URL naming several hosts
    (``?host=h1:5432&host=h2:5432``) is not one libpq can read as text."""
    args, params = _DIALECT.create_connect_args(make_url(url))  # type: ignore[no-untyped-call]
    return psycopg.connect(*args, **{**params, **options, **CONNECT_ARGS})


def _session_settings(settings: Mapping[str, str], dbapi_connection: Any, _record: Any) -> None:
    set_session(dbapi_connection, settings)


#: Tries of the statement that lifts a session's ``statement_timeout`` (:func:`set_session`).
SET_TRIES = 3


def set_session(connection: psycopg.Connection[Any], settings: Mapping[str, str]) -> None:
    """SET ``settings`` and the server's side of the connection's TCP timeouts. A
    ``statement_timeout`` among them is SET first, alone, in the shortest statement there
    is: one of a millisecond (in the URL's ``options``, or the role's) cancelled the
    statement that sets them all about one time in ten."""
    if "statement_timeout" in settings:
        lift = sql.SQL("SET statement_timeout = {}").format(
            sql.Literal(settings["statement_timeout"]))
        for tries_left in reversed(range(SET_TRIES)):
            try:
                connection.execute(lift)
                break
            except psycopg.errors.QueryCanceled:  # even that one, now and then
                connection.rollback()
                if not tries_left:
                    raise
    connection.execute(settings_sql({**settings, **server_tcp_timeouts(connection)}))
    connection.commit()


def settings_sql(settings: Mapping[str, str]) -> str:
    """One statement that SETs ``settings`` for the session, but those the server does not
    know (``transaction_timeout`` before PostgreSQL 17), where a SET would fail. One
    statement, so a role's short ``statement_timeout`` cannot cancel those after the first
    (0.7 ms where ten SETs took 1.8, BENCHMARKS.md)."""
    rows = sql.SQL(", ").join(sql.SQL("({}, {})").format(sql.Literal(name), sql.Literal(value))
                              for name, value in settings.items())
    return sql.SQL("SELECT count(set_config(v.name, v.setting, false)) "
                   "FROM (VALUES {}) AS v(name, setting) "
                   "WHERE current_setting(v.name, true) IS NOT NULL").format(rows).as_string()


#: libpq's parameters that end a silent connection (settings.tcp_timeouts), and the server's
#: settings of the same meaning.
_SERVER_TCP_SETTINGS = {"keepalives_idle": "tcp_keepalives_idle",
                        "keepalives_interval": "tcp_keepalives_interval",
                        "keepalives_count": "tcp_keepalives_count",
                        "tcp_user_timeout": "tcp_user_timeout"}


def server_tcp_timeouts(connection: psycopg.Connection[Any]) -> dict[str, str]:
    """The server's side of ``connection``'s own timeouts. A session whose client vanished
    without a reset otherwise lives on until the server's kernel gives up (two hours by
    default), holding its locks (a relay's worker id, its wake locks, which make every
    publish notify) and a connection slot."""
    return server_tcp_settings(connection.info.get_parameters())


def server_tcp_settings(params: Mapping[str, str]) -> dict[str, str]:
    """The server's settings for libpq's TCP timeout parameters among ``params``."""
    return {server: str(int(params[client])) for client, server in _SERVER_TCP_SETTINGS.items()
            if ascii_digits(params.get(client, ""))}


#: The least time between two reads of the list of ranges (:meth:`Fetching.range_of`).
RANGES_REREAD_SECONDS = 1.0


class Fetching:
    """The relay's fetching connection, whose statements are planned once
    (:data:`FETCHING_SETTINGS`), and the ranges of ``message`` it reads batches from
    (:func:`fetch_deliverable`). ``conn`` is made autocommit: a failed read leaves it usable."""

    def __init__(self, conn: Connection, schema: str) -> None:
        self.conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        self.schema = schema
        self._lows: list[int] = []  # of the ranges, ascending
        self._ranges: list[tuple[str, int]] = []  # (name, high) of each, in the same order
        self._read_at = -math.inf  # monotonic time the list was last read
        #: False once a read of a range was refused (a role without revision 0015's grant).
        self.direct = True
        #: The range the last batch was read from: the next batch is fetched in one
        #: statement that reads its messages there (:meth:`batch`).
        self.hot: str | None = None

    def range_of(self, low: int, high: int) -> str | None:
        """The range that holds every id from ``low`` to ``high``; None when they span two,
        or lie where no range is known (the default partition). The list is read again for
        ids beyond the newest range known, at most every ``RANGES_REREAD_SECONDS``."""
        beyond = not self._ranges or high >= self._ranges[-1][1]
        if beyond and time.monotonic() - self._read_at >= RANGES_REREAD_SECONDS:
            rows = _driver_rows(self.conn, "message_ranges", self.schema, {})
            self._lows = [row[1] for row in rows]
            self._ranges = [(row[0], row[2]) for row in rows]
            self._read_at = time.monotonic()
        at = bisect.bisect_right(self._lows, low) - 1
        if at < 0 or high >= self._ranges[at][1]:
            return None
        return self._ranges[at][0]

    def batch(self, params: dict[str, Any]) -> list[Any] | None:
        """``fetch_batch``: the next batch's ids and their messages from the hot range, in
        one statement planned once; None when no range is hot. A row whose message is not
        in that range comes with a NULL topic (the caller then reads the batch's ids again)."""
        if self.hot is None:
            return None
        return self._guarded(self.hot, _batch_sql(self.schema, self.hot), params)

    def read(self, params: dict[str, Any]) -> list[Any] | None:
        """``read_deliverable`` from the range of the batch's ids, planned once; None when
        there is no such range or it cannot be read (then the caller reads the parent)."""
        name = self.range_of(params["low"], params["high"]) if self.direct else None
        if name is None:
            return None
        rows = self._guarded(name, _range_sql(self.schema, name), params)
        if rows is not None:
            self.hot = name
        return rows

    def _guarded(self, name: str, sql: str, params: dict[str, Any]) -> list[Any] | None:
        """``sql``'s rows, or None if the range ``name`` it reads is gone or refused."""
        try:
            return _run(self.conn, sql, params, binary=True)
        except psycopg.errors.UndefinedTable:  # dropped by retention since the list was read
            self._read_at = -math.inf
            self._ranges.clear()
            self._lows.clear()
        except psycopg.errors.InsufficientPrivilege:
            self.direct = False
            log.warning("the relay's role may not read %s.%s directly: every batch is read "
                        "through %s.message, planned for each batch; run `outbox db upgrade "
                        "--create-roles` to grant it (revision 0015)",
                        self.schema, name, self.schema)
        self.hot = None
        return None


@cache
def _range_sql(schema: str, name: str) -> str:
    """``read_deliverable`` reading the range ``name`` instead of its parent ``message``."""
    sql = _driver_sql("read_deliverable", schema)
    parent = f"{schema}.message AS m"
    assert sql.count(parent) == 1, "read_deliverable reads message once"
    return sql.replace(parent, f"{schema}.{validate_identifier(name)} AS m")


@cache
def _batch_sql(schema: str, name: str) -> str:
    """``fetch_batch`` (``fetch_deliverable`` as its ids) reading the range ``name``."""
    return _driver_sql("fetch_batch", schema).replace("{range}", validate_identifier(name))


class IdRanges(NamedTuple):
    """Ids as the body of an ``int8multirange`` literal (:func:`id_ranges`), rendered once and
    joined cheaply: the relay renders each batch's ids when it sends the batch, and joins
    those of the batches in flight for each fetch (up to 3: the loop fetches only with room
    in its pipeline of 4).
    Rendered at every fetch instead, ids with no runs (those of several relays interleave)
    cost twice an array's rendering, about 0.7 µs a message of the relay's interpreter."""

    size: int = 0
    ranges: str = ""  # e.g. "[1,3],[7,7]"

    @classmethod
    def of(cls, ids: Collection[int]) -> IdRanges:
        return cls(len(ids), id_ranges(ids)[1:-1])

    @classmethod
    def joined(cls, parts: Iterable[IdRanges]) -> IdRanges:
        """One set of ids from disjoint ones (PostgreSQL sorts and merges the ranges)."""
        parts = [part for part in parts if part.size]
        return cls(sum(part.size for part in parts), ",".join(part.ranges for part in parts))

    @property
    def literal(self) -> str:
        return "{" + self.ranges + "}"


def id_ranges(values: Iterable[int]) -> str:
    """``values`` as an ``int8multirange`` literal, each run of consecutive ids one range,
    for a ``CAST(:name AS int8multirange) @> id`` test: the ids a relay has in flight. As an
    array, ``<> ALL`` had the planner weigh each id: 2.8 ms of planning with 6,000 in flight,
    0.5 ms as ranges (BENCHMARKS.md, "The ids in flight as ranges, session 28")."""
    runs: list[str] = []
    first = last = None
    for value in values:
        if type(value) is not int:
            raise TypeError(f"an id must be an int, not {type(value).__name__}")
        if last is not None and value == last + 1:
            last = value
            continue
        if last is not None:
            runs.append(f"[{first},{last}]")
        first = last = value
    if last is not None:
        runs.append(f"[{first},{last}]")
    return "{" + ",".join(runs) + "}"


NONE_IN_FLIGHT = IdRanges()


def fetch_deliverable(
    conn: Connection,
    schema: str,
    shards: Iterable[int],
    limit: int,
    in_flight: IdRanges = NONE_IN_FLIGHT,
    max_bytes: int = RELAY_BATCH_BYTES,
    held: Iterable[str] = (),
    fetching: Fetching | None = None,
) -> list[Deliverable]:
    """The relay's next batch: at most ``limit`` rows and ``max_bytes`` of payload (at least
    one row). Two statements, the ids then their messages (queries.sql says why), or one
    under a trickle (below). Runs on the driver with binary results: payloads arrive as raw
    bytes instead of hex text, which more than halves the cost of the hot fetch.

    Under a trickle (2-3 rows a batch) planning was most of the relay's database time, so
    both statements run on ``fetching`` where they can, planned once:

    * the ids, always. The relay's p50 commit → op record at 1,000 msg/s was 0.7-3.3 ms
      lower in each of 5 alternated rounds (BENCHMARKS.md, "Latency, session 22"). Until the
      ids in flight went as ranges, a plan made once compared each row with each of them, so
      a backlog's fetches (thousands in flight) were planned for their parameters on
      ``conn`` ("The fetch planned once under a backlog, session 29");
    * the messages, when one range of ``message`` holds them all: read from that range, a
      plan made once locks it alone, where one of the parent would lock every range of
      retained history ("Latency, session 23"). Otherwise through the parent, on ``conn``,
      planned for the ranges between the batch's first and last id.

    With a range hot (the last batch was read from it), both steps are one statement,
    ``fetch_batch``: one round trip a batch ("Latency, session 24"). If any of its messages
    lies elsewhere, the batch's ids are read again by the second step."""
    params = {"shards": int_array(shards), "limit": limit, "in_flight": in_flight.literal,
              "held": list(held)}
    rows = fetching.batch({**params, "max_bytes": max_bytes}) if fetching is not None else None
    if rows is not None and all(row[1] is not None for row in rows):  # each has its topic
        return list(map(Deliverable._make, rows))
    if rows is not None:  # some messages lie outside the hot range
        ids = [row[0] for row in rows]
    else:
        choosing = fetching.conn if fetching is not None else conn
        ids = [row[0] for row in _driver_rows(choosing, "fetch_deliverable", schema, params)]
    if not ids:
        return []
    params = {"ids": int_array(ids), "low": ids[0], "high": ids[-1], "max_bytes": max_bytes}
    rows = fetching.read(params) if fetching is not None else None
    if rows is None:
        rows = _driver_rows(conn, "read_deliverable", schema, params, binary=True)
    return list(map(Deliverable._make, rows))


def _driver_rows(conn: Connection, name: str, schema: str, params: dict[str, Any],
                 *, binary: bool = False) -> list[Any]:
    """The named query's rows as plain tuples, run on the driver connection under ``conn``
    (in its transaction): for the relay's hot statements, whose thousands of rows a batch
    cost more as SQLAlchemy rows than the statements' own work."""
    return _run(conn, _driver_sql(name, schema), params, binary=binary)


def _run(conn: Connection, sql: str, params: dict[str, Any], *, binary: bool) -> list[Any]:
    driver = conn.connection.driver_connection
    assert driver is not None
    try:
        with driver.cursor(binary=binary) as cursor:
            cursor.execute(sql, params)
            rows: list[Any] = cursor.fetchall()
    except psycopg.Error:
        if driver.broken or driver.closed:  # SQLAlchemy did not see it go: the pool would
            conn.invalidate()  # roll it back on return and log a traceback for it
        raise
    return rows


def int_array(values: Iterable[int]) -> str:
    """``values`` as an array literal for a ``CAST(:name AS bigint[])`` parameter (also
    ``integer[]``, ``smallint[]``). psycopg dumps a list element by element in Python: a
    batch's 2,000 acks (ids, partitions, offsets) took 5.6 ms of client CPU that way, 1.1 ms
    this way, and the relay passes them with every batch. ``int.__repr__`` renders an int
    alone (anything else raises TypeError), in two thirds of ``str(int(value))``'s time."""
    return "{" + ",".join(map(int.__repr__, values)) + "}"


def _driver_sql(name: str, schema: str) -> str:
    return driver_sql(query(name, schema))


def driver_sql(statement: TextClause) -> str:
    """``statement`` in psycopg's ``%(name)s`` style, for connections SQLAlchemy does not hold
    (the relay's binary fetch, plain psycopg and Django connections)."""
    return _compiled(statement.text)


@cache
def _compiled(sql: str) -> str:
    return str(text(sql).compile(dialect=_DIALECT))


def fall_asleep(driver: psycopg.Connection[Any], schema: str, shards: Iterable[int]) -> bool:
    """Take the wake locks of ``shards`` on ``driver`` (the relay's LISTEN connection):
    False, holding none, when a publisher held one past the connection's lock_timeout."""
    params = {"wake_class": WAKE_LOCK_CLASS, "wake_base": wake_base(schema),
              "shards": int_array(sorted(shards))}
    try:
        driver.execute(_driver_sql("fall_asleep", schema), params)
    except psycopg.errors.LockNotAvailable:
        rise(driver, schema)
        return False
    return True


def rise(driver: psycopg.Connection[Any], schema: str) -> None:
    """Let go of every wake lock ``driver`` holds."""
    driver.execute(_driver_sql("rise", schema))


def promote_due(
    conn: Connection, schema: str, shards: Iterable[int]
) -> tuple[int, float | None]:
    """Make due DELAYED rows deliverable; returns (how many, seconds until the next is due)."""
    row = conn.execute(query("promote_due", schema), {"shards": int_array(shards)}).one()
    return int(row.promoted), None if row.next_due_in is None else float(row.next_due_in)


def resume(conn: Connection, schema: str, actor: str, ids: Sequence[int] = (),
           *, resume_all: bool = False) -> list[tuple[int, str]]:
    """Re-queue PARKED and re-arm DISCARDED rows; returns (id, what it was) for each."""
    rows = conn.execute(
        query("resume", schema),
        {"ids": int_array(ids), "all": resume_all, "actor": actor,
         "channel": notify_channel(schema)},
    )
    return [(row.message_id, row.detail.removeprefix("was ")) for row in rows]


def mark_delivered(
    conn: Connection,
    schema: str,
    actor: str,
    acks: Sequence[tuple[int, int, int]],
) -> list[tuple[str, float]]:
    """Record ``(message id, partition, offset)`` acknowledgements as op records.

    Returns ``(topic, publish-to-ack seconds)`` for each row this call closed.
    """
    if not acks:
        return []
    ids, partitions, offsets = (int_array(column) for column in zip(*acks, strict=True))
    params = {"ids": ids, "partitions": partitions, "offsets": offsets, "actor": actor}
    return _driver_rows(conn, "mark_delivered", schema, params)


#: What PostgreSQL's text refuses: NUL, and lone surrogates (which UTF-8 cannot encode).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def as_text(value: str | bytes) -> str:
    """``value`` as PostgreSQL text holds it: bytes decoded as UTF-8, and invalid UTF-8, NUL
    and lone surrogates replaced by U+FFFD. An error's text (a checker's, a broker's) or a
    binary key refused by the driver would fail the statement recording it."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return _UNSTORABLE.sub("\ufffd", text)


#: The most characters of an error or a check's detail that an op record (and a log line)
#: holds: a checker's error may carry anything, ten million characters of it.
DETAIL_CHARS = 500


def as_detail(value: str) -> str:
    """``value`` as text (:func:`as_text`), cut to :data:`DETAIL_CHARS` with its length said
    (cut once: a detail cut already is not cut again)."""
    text = as_text(value)
    if len(text) <= DETAIL_CHARS:
        return text
    said = f"... ({len(text)} characters)"
    return text[:DETAIL_CHARS - len(said)] + said


@dataclass(frozen=True, slots=True)
class Failure:
    id: int
    error: str
    permanent: bool


def record_failures(
    conn: Connection, schema: str, actor: str, failures: Sequence[Failure], max_attempts: int
) -> list[tuple[int, str]]:
    """Note failed sends, counting the permanent rejections; returns ``(id, topic)`` of the
    rows parked by this call."""
    if not failures:
        return []
    rows = conn.execute(
        query("record_failures", schema),
        {
            "ids": int_array(f.id for f in failures),
            "errors": [as_detail(f.error) for f in failures],
            "permanent": [f.permanent for f in failures],
            "max_attempts": max_attempts,
            "actor": actor,
        },
    )
    return [(row.id, row.topic) for row in rows if row.status == "PARKED"]


def mark_held(conn: Connection, schema: str, reasons: Mapping[str, str],
              shards: Iterable[int], limit: int) -> int:
    """Note each held topic's reason (starting with ``held: ``) on at most ``limit`` of its
    waiting rows not noted yet, and flag them held; returns how many."""
    return int(conn.execute(query("mark_held", schema), {
        "topics": list(reasons), "reasons": [as_text(r) for r in reasons.values()],
        "shards": int_array(shards), "limit": limit}).scalar_one())


def release_held(conn: Connection, schema: str, topics: Collection[str],
                 shards: Iterable[int], limit: int) -> int:
    """At most ``limit`` held rows of released topics in ``shards`` rejoin the fetch;
    returns how many."""
    return int(conn.execute(query("release_held", schema), {
        "topics": list(topics), "shards": int_array(shards), "limit": limit}).scalar_one())


#: Where a topic's renote stands (``renote_held``): the last row noted, in
#: ``pending_held_idx``'s order (shard, message id); ``(-1, 0)`` before the first.
Cursor = tuple[int, int]
CURSOR_START: Cursor = (-1, 0)


def renote_held(conn: Connection, schema: str, topic: str, reason: str, shards: Iterable[int],
                limit: int, after: Cursor) -> tuple[int, Cursor]:
    """Note ``reason`` on at most ``limit`` of a held topic's flagged rows in ``shards`` past
    ``after``; returns how many, and where the next step starts."""
    row = conn.execute(query("renote_held", schema), {
        "topic": topic, "reason": as_text(reason), "shards": int_array(shards),
        "limit": limit, "after_shard": after[0], "after_id": after[1]}).one()
    return int(row.rows), (int(row.last[0]), int(row.last[1])) if row.rows else after


def try_held(conn: Connection, schema: str, topics: Collection[str],
             shards: Iterable[int]) -> int:
    """The first held row of each of ``topics`` per shard of ``shards`` that no earlier row
    of its key holds back rejoins the fetch; returns how many."""
    return conn.execute(query("try_held", schema), {
        "topics": list(topics), "shards": int_array(shards)}).rowcount


def flagged_topics(conn: Connection, schema: str, kept: Collection[str],
                   shards: Iterable[int]) -> dict[str, str | None]:
    """The topics, but ``kept``, with rows of ``shards`` flagged held, and the note of one of
    those rows each."""
    rows = conn.execute(query("flagged_topics", schema), {
        "kept": list(kept), "shards": int_array(shards)})
    return {row.topic: row.note for row in rows}


def park_topic(conn: Connection, schema: str, actor: str, topic: str, shards: Iterable[int],
               reason: str, limit: int) -> int:
    """Park at most ``limit`` of a held topic's waiting rows with ``reason``; returns how
    many."""
    return int(conn.execute(query("park_topic", schema), {
        "topic": topic, "shards": int_array(shards), "reason": as_text(reason), "actor": actor,
        "limit": limit}).scalar_one())


def lock_migrations(conn: Connection, schema: str, lock_timeout: str) -> None:
    """Wait for, then hold until the transaction ends, the lock of ``schema``'s migrations;
    from then on each statement waits ``lock_timeout`` at most for a lock."""
    params = {"lock_class": MIGRATION_LOCK_CLASS, "schema_name": schema,
              "lock_timeout": lock_timeout}
    conn.execute(query("lock_migrations", schema), params)


def lock_holders(conn: Connection, schema: str) -> str:
    """The oldest transactions holding locks on ``schema``'s tables, in one line (for a
    command that gave up waiting behind them)."""
    rows = conn.execute(query("lock_holders", schema), {"schema_name": schema})
    return "; ".join(
        f"pid {row.pid} (role {row.role}, application {row.application_name!r}, "
        f"{row.state} in a transaction of {row.seconds or 0:.0f}s: {row.query!r})"
        for row in rows) or "a transaction now ended"


def claim_worker_id(conn: Connection, schema: str, worker_id: str) -> bool:
    """Take this process's worker id for the life of ``conn``; False if a live one has it."""
    params = {"lock_class": WORKER_LOCK_CLASS, "schema_name": schema, "worker_id": worker_id}
    return bool(conn.execute(query("claim_worker_id", schema), params).scalar_one())


def release_worker_id(conn: Connection, schema: str, worker_id: str) -> None:
    """Let go of the worker id :func:`claim_worker_id` took on ``conn``, at once (a closed
    connection's backend lets go a moment later: a relay started right after was refused)."""
    params = {"lock_class": WORKER_LOCK_CLASS, "schema_name": schema, "worker_id": worker_id}
    conn.execute(query("release_worker_id", schema), params)


def end_lost_sessions(conn: Connection, schema: str, session_name: str) -> int:
    """End this process's other sessions named ``session_name`` (a connection lost without
    the server hearing of it lives on, holding its locks); how many there were."""
    return int(conn.execute(query("end_lost_sessions", schema),
                            {"session_name": session_name}).scalar_one())


def heartbeat(
    conn: Connection, schema: str, worker_id: str, lease_seconds: float, in_flight: int = 0,
    paused: tuple[float, str] | None = None,
) -> int:
    """Announce this relay (``paused``: for how many seconds, and why) and return how many
    relays are alive; a newcomer tells the others."""
    seconds, reason = paused or (None, None)
    params = {"worker_id": worker_id, "lease_seconds": lease_seconds, "in_flight": in_flight,
              "paused_seconds": seconds, "paused_reason": as_text(reason) if reason else None}
    if conn.execute(query("heartbeat", schema), params).scalar_one():
        conn.execute(query("notify_rebalance", schema), {"channel": notify_channel(schema)})
    return int(conn.execute(query("live_relays", schema), params).scalar_one())


def renew_leases(conn: Connection, schema: str, worker_id: str, lease_seconds: float) -> set[int]:
    rows = conn.execute(
        query("renew_leases", schema), {"worker_id": worker_id, "lease_seconds": lease_seconds}
    )
    return {row.shard for row in rows}


def claim_leases(
    conn: Connection, schema: str, worker_id: str, lease_seconds: float, wanted: int
) -> dict[int, bool]:
    """Take up to ``wanted`` free or expired shards; returns whether each was handed back
    clean (False: its last owner died, and sends of it may be unrecorded)."""
    rows = conn.execute(
        query("claim_leases", schema),
        {"worker_id": worker_id, "lease_seconds": lease_seconds, "wanted": wanted},
    )
    return {row.shard: row.was_clean for row in rows}


def settle_leases(conn: Connection, schema: str, worker_id: str, shards: Sequence[int]) -> None:
    conn.execute(query("settle_leases", schema),
                 {"worker_id": worker_id, "shards": int_array(shards)})


def release_leases(conn: Connection, schema: str, worker_id: str, shards: Sequence[int],
                   unsettled: Sequence[int] = ()) -> None:
    conn.execute(
        query("release_leases", schema),
        {"worker_id": worker_id, "shards": int_array(shards), "unsettled": int_array(unsettled),
         "channel": notify_channel(schema)},
    )


def leave(conn: Connection, schema: str, worker_id: str, unsettled: Sequence[int] = ()) -> None:
    conn.execute(
        query("leave", schema),
        {"worker_id": worker_id, "unsettled": int_array(unsettled),
         "channel": notify_channel(schema)},
    )


def abandon_leases(conn: Connection, schema: str, worker_id: str, grace_seconds: float,
                   wait_seconds: float) -> int:
    """End this relay's leases within ``grace_seconds``, not clean, and leave the relays'
    list, waiting ``wait_seconds`` at most (a lock, a slow server); returns how many shards
    it held."""
    conn.execute(query("cut_off_after", schema), {"timeout_ms": _milliseconds(wait_seconds)})
    return int(conn.execute(query("abandon_leases", schema), {
        "worker_id": worker_id, "grace_seconds": grace_seconds,
        "channel": notify_channel(schema)}).scalar_one())


def next_lease_expiry(conn: Connection, schema: str, worker_id: str) -> float | None:
    """Seconds until the first lease of another relay ends; None when no other holds one."""
    seconds = conn.execute(query("next_lease_expiry", schema),
                           {"worker_id": worker_id}).scalar_one()
    return None if seconds is None else float(seconds)


def unrecorded_candidates(conn: Connection, schema: str, shards: Sequence[int]
                          ) -> list[tuple[str, bytes | None, datetime]]:
    """``(topic, key, sent after)`` of the pending messages of ``shards`` (see
    relay/recovery.py)."""
    rows = conn.execute(query("unrecorded_candidates", schema), {"shards": int_array(shards)})
    return [(row.topic, None if row.key is None else bytes(row.key), row.sent_after)
            for row in rows]


def doubted_candidates(conn: Connection, schema: str, ids: Sequence[int]
                       ) -> list[tuple[str, bytes | None, datetime]]:
    """As :func:`unrecorded_candidates`, of the messages ``ids`` still pending."""
    rows = conn.execute(query("doubted_candidates", schema), {"ids": int_array(ids)})
    return [(row.topic, None if row.key is None else bytes(row.key), row.sent_after)
            for row in rows]


def recorded_offsets(conn: Connection, schema: str,
                     windows: Mapping[tuple[str, int], tuple[datetime, datetime]]
                     ) -> dict[tuple[str, int], int]:
    """Per ``(topic, partition)``, the highest offset recorded as DELIVERED in its window
    ``[since, before)``."""
    if not windows:
        return {}
    (topics, partitions), (sinces, befores) = zip(*windows, strict=True), \
        zip(*windows.values(), strict=True)
    rows = conn.execute(query("recorded_offsets", schema), {
        "topics": list(topics), "partitions": int_array(partitions),
        "sinces": list(sinces), "befores": list(befores),
        "since": min(sinces), "before": max(befores)})
    return {(row.topic, row.partition): row.kafka_offset for row in rows
            if row.kafka_offset is not None}


def pending_in_shards(conn: Connection, schema: str, worker_id: str, ids: Sequence[int],
                      shards: Sequence[int]) -> list[tuple[int, str, bytes | None, bytes]]:
    """Which of ``ids`` are pending in ``shards`` under this relay's live leases: each one's
    id, topic, key and the SHA-256 of its payload (relay/tails.py's fingerprint)."""
    rows = conn.execute(query("pending_in_shards", schema),
                        {"ids": int_array(ids), "shards": int_array(shards),
                         "worker_id": worker_id})
    return [(row.message_id, row.topic, row.key, row.digest) for row in rows]


def backlog(conn: Connection, schema: str, timeout_seconds: float | None = None
            ) -> tuple[dict[str, int], float]:
    """Undelivered messages by state (pending, unresolved, delayed, parked, discarded), and
    the seconds the oldest committed pending message has waited (0 when none waits). It
    reads every row of ``pending``; with ``timeout_seconds`` (in a transaction) it is cut
    off after that long (QueryCanceled)."""
    if timeout_seconds is not None:
        conn.execute(query("cut_off_after", schema),
                     {"timeout_ms": _milliseconds(timeout_seconds)})
    row = dict(conn.execute(query("backlog", schema)).one()._mapping)
    oldest = row.pop("oldest_pending_seconds")
    return {k: int(v) for k, v in row.items()}, float(oldest or 0.0)


def status_by_topic(conn: Connection, schema: str) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in conn.execute(query("status_by_topic", schema))]


def relays(conn: Connection, schema: str, lease_seconds: float) -> list[dict[str, Any]]:
    rows = conn.execute(query("relays", schema), {"lease_seconds": lease_seconds})
    return [dict(row._mapping) for row in rows]


class DroppedPartition(NamedTuple):
    """A range of message ids retention dropped, and how many unfinished messages it kept."""

    name: str
    low: int | None
    high: int
    kept: int


def ensure_partitions(conn: Connection, schema: str, size: int,
                      ahead: int = PARTITIONS_AHEAD) -> int:
    """Create the range partitions the next ids need; returns how many were made."""
    return int(conn.execute(query("ensure_partitions", schema),
                            {"size": size, "ahead": ahead}).scalar_one())


def written_span(conn: Connection, schema: str) -> tuple[int, float] | None:
    """Ids from the oldest range's first message to the newest one, and the seconds between
    them (None when no message is written)."""
    row = conn.execute(query("written_span", schema)).one_or_none()
    return None if row is None else (int(row.ids), float(row.seconds))


def history_ranges(conn: Connection, schema: str) -> list[str]:
    """The range partitions of ``message`` and ``op_record``, by name."""
    return list(conn.execute(query("history_ranges", schema)).scalars())


def tend_range(conn: Connection, schema: str, name: str) -> str:
    """Summarize a range's new BRIN block ranges and analyze it if due; returns what it did
    (``untouched``, ``summarized``, ``analyzed``, ``busy`` or ``gone``)."""
    return str(conn.execute(query("tend_range", schema), {"name": name}).scalar_one())


def drop_expired_partition(conn: Connection, schema: str, retention_seconds: float
                           ) -> DroppedPartition | None:
    """Drop the oldest partition past the window (None when none is)."""
    row = conn.execute(query("drop_expired_partition", schema),
                       {"retention_seconds": retention_seconds}).one_or_none()
    return None if row is None else DroppedPartition(*row)


def prune_default(conn: Connection, schema: str, retention_seconds: float, limit: int
                  ) -> tuple[int, int]:
    """Delete one bounded batch of the default partition's expired finished messages with
    their op records; returns how many (messages, op records) went."""
    params = {"retention_seconds": retention_seconds, "limit": limit}
    row = conn.execute(query("prune_default", schema), params).one()
    return int(row.messages), int(row.op_records)


def schema_version(conn: Connection, schema: str) -> str | None:
    """The applied migration revision, or None when the schema was never migrated."""
    table = f"{validate_identifier(schema)}.outbox_alembic_version"
    if not conn.execute(query("table_exists", schema), {"table": table}).scalar_one():
        return None
    return conn.execute(query("schema_version", schema)).scalar_one_or_none()


def decide(
    schema: str, message_id: int, resolution: Resolution, actor: str
) -> tuple[TextClause, dict[str, Any]]:
    """The statement that records an application's COMMIT or ROLLBACK (run by the caller).

    It returns no row for an unknown id, else ``(was_resolution, decided, notified)``.
    """
    return query("decide", schema), {
        "id": message_id,
        "resolution": resolution.value,
        "actor": actor,
        "channel": notify_channel(schema),
    }


@dataclass(frozen=True, slots=True)
class Claim:
    """A due UNKNOWN row a sweeper holds; ``token`` (its new next_check_at) proves it."""

    message: Message
    token: datetime
    #: why the row cannot be handed to a checker (:class:`UnpairedHeaders`), if it cannot
    unreadable: str | None = None


def claim_checks(
    conn: Connection, schema: str, groups: Sequence[str], limit: int, claim_seconds: float
) -> list[Claim]:
    rows = conn.execute(
        query("claim_checks", schema),
        {"groups": list(groups), "limit": limit, "claim_seconds": claim_seconds},
    )
    return [_claim(row) for row in rows]


def _claim(row: Any) -> Claim:
    try:
        headers, unreadable = dict(paired_headers(row.header_keys, row.header_values)), None
    except UnpairedHeaders as exc:
        headers, unreadable = {}, str(exc)
    message = Message(id=row.id, producer_group=row.producer_group, topic=row.topic,
                      key=row.key, headers=headers, payload=row.payload,
                      content_type=row.content_type, check_count=row.check_count)
    return Claim(message, row.token, unreadable)


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    """What one check-back found, to be recorded under its claim's token."""

    id: int
    token: datetime
    resolution: Resolution
    detail: str


@dataclass(frozen=True, slots=True)
class CheckRecorded:
    """A row a check-back outcome changed (outcomes whose claim had lapsed change nothing)."""

    id: int
    producer_group: str
    resolution: Resolution
    status: str
    check_count: int


def record_checks(
    conn: Connection,
    schema: str,
    actor: str,
    outcomes: Sequence[CheckOutcome],
    *,
    check_interval: float,
    check_max: int,
    late: bool = False,
) -> list[CheckRecorded]:
    """Record ``outcomes`` under their claims; or, ``late``, COMMIT and ROLLBACK answers that
    came after their checks' timeouts were counted: uncounted, they decide their rows if still
    UNKNOWN (PENDING or DELAYED), whatever claim holds them."""
    if not outcomes:
        return []
    rows = conn.execute(
        query("record_checks", schema),
        {
            "ids": int_array(o.id for o in outcomes),
            "tokens": [o.token for o in outcomes],
            "resolutions": [o.resolution.value for o in outcomes],
            "details": [as_detail(o.detail) for o in outcomes],
            "check_interval": check_interval,
            "check_max": check_max,
            "counted": 0 if late else 1,
            "actor": actor,
            "channel": notify_channel(schema),
        },
    )
    return [
        CheckRecorded(row.id, row.producer_group, Resolution(row.resolution), row.status,
                      row.check_count)
        for row in rows
    ]


def next_check_in(conn: Connection, schema: str, groups: Sequence[str]) -> float | None:
    """Seconds until the next row of ``groups`` is due (negative if overdue; None if none)."""
    seconds = conn.execute(query("next_check_in", schema), {"groups": list(groups)}).scalar()
    return None if seconds is None else float(seconds)


def unchecked_groups(conn: Connection, schema: str, groups: Sequence[str]) -> dict[str, int]:
    """Due UNKNOWN rows per producer group that is not among ``groups``."""
    rows = conn.execute(query("unchecked_groups", schema), {"groups": list(groups)})
    return {row.producer_group: int(row.due) for row in rows}


def begin_check(conn: Connection, schema: str, timeout_seconds: float, idle_seconds: float
                ) -> None:
    """Make the open transaction read-only, with statements cut off after the timeout and
    the session ended once the transaction is idle for ``idle_seconds``."""
    conn.execute(query("begin_check", schema), {"timeout_ms": _milliseconds(timeout_seconds),
                                                "idle_ms": _milliseconds(idle_seconds)})


def _milliseconds(seconds: float) -> str:
    """A timeout for ``set_config``: whole milliseconds, at least 1 (0 would mean none)."""
    return str(max(1, round(seconds * 1000)))


def cut_off(exc: BaseException) -> bool:
    """Whether ``exc`` is a statement cancelled by its timeout (``begin_check``, a cut-off
    ``backlog``) or by a cancel request."""
    return isinstance(getattr(exc, "orig", None), psycopg.errors.QueryCanceled)


#: The binds a SQL checker may use, in the order of run_sql_checker's parameters, and their
#: types (PostgreSQL oids: bigint, text x4, integer).
CHECKER_BINDS = ("id", "producer_group", "topic", "key", "payload", "check_count")
_CHECKER_TYPES = (20, 25, 25, 25, 25, 23)
#: The name a SQL checker is prepared under for one check (dropped by ``reset_session``;
#: queries.sql's ``plan_sql_checker`` names it too).
CHECKER_STATEMENT = "outbox_sql_checker"
_PYFORMAT_BIND = re.compile(r"%\((\w+)\)s|%%")


def positional_checker(sql: str) -> str:
    """``sql`` with its ``:name`` binds as ``$1``..``$6`` (the order of CHECKER_BINDS), as
    SQLAlchemy's ``text()`` finds them. An unknown name raises ValueError naming it."""

    def positional(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "%"
        if match.group(1) not in CHECKER_BINDS:
            raise ValueError(f"binds :{match.group(1)}; a SQL checker may bind "
                             + ", ".join(f":{name}" for name in CHECKER_BINDS))
        return f"${CHECKER_BINDS.index(match.group(1)) + 1}"

    return _PYFORMAT_BIND.sub(positional, driver_sql(text(sql)))


def prepare_sql_checker(conn: Connection, schema: str, statement: str) -> None:
    """Prepare ``statement`` (see positional_checker) as the checker role, for
    run_sql_checker. It is sent alone in a Parse message of the extended query protocol,
    which PostgreSQL refuses to hold more than one statement; it must answer with a column.
    The prepared statement outlives the transaction: ``reset_session`` drops it.

    Sent and awaited as psycopg sends its own statements. psycopg's blocking
    ``describe_prepared`` holds the interpreter lock through its round trip: every thread of
    the sweeper stopped until the server answered (for good when the connection ran through a
    forwarder in the same process, until the TCP timeout on a silent network)."""
    from psycopg import generators, pq

    conn.execute(query("sql_checker_as_checker", schema))
    driver = conn.connection.driver_connection
    assert driver is not None
    pgconn, name = driver.pgconn, CHECKER_STATEMENT.encode()
    for send in (partial(pgconn.send_prepare, name, statement.encode(driver.info.encoding),
                         _CHECKER_TYPES),
                 partial(pgconn.send_describe_prepared, name)):
        try:
            send()
            result = driver.wait(generators.execute(pgconn))[-1]
        except psycopg.Error as exc:  # the connection's trouble, not the statement's
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from None
        if result.status != pq.ExecStatus.COMMAND_OK:
            error = psycopg.errors.error_from_result(result, driver.info.encoding)
            if isinstance(error, psycopg.errors.QueryCanceled):  # see cut_off
                raise DBAPIError.instance(None, None, error, psycopg.Error)
            message = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or b"refused"
            raise CheckerRefused(message.decode(driver.info.encoding, errors="replace"))
    if result.nfields == 0:
        raise CheckerRefused("it returns no column; a SQL checker is one query whose first "
                             "column answers COMMIT, ROLLBACK or UNKNOWN")
    conn.execute(query("sql_checker_as_sweeper", schema))


#: Plan nodes of a statement that locks or writes rows: a check's read-only transaction
#: refuses it (``cannot execute SELECT FOR UPDATE in a read-only transaction``).
_WRITING_NODES = frozenset({"LockRows", "ModifyTable"})


def sql_checker_refusal(conn: Connection, schema: str) -> str | None:
    """Why the SQL checker just prepared (prepare_sql_checker) would fail at every check, if
    its plan shows it: a privilege the checker role lacks, or rows it would lock or write.
    None if its plan is sound, or cannot be made with NULL binds (its checks will tell)."""
    try:
        with conn.begin_nested():
            conn.execute(query("sql_checker_as_checker", schema))
            plan = conn.execute(query("plan_sql_checker", schema)).scalar_one()
    except DBAPIError as exc:
        if sqlstate(exc) == INSUFFICIENT_PRIVILEGE:
            return (f"{first_line(exc)} (it runs as the role {schema}_checker: grant that role "
                    "SELECT on what it reads, and lock no rows)")
        if server_trouble(exc):
            raise
        return None
    nodes = _plan_nodes((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    if nodes & _WRITING_NODES:
        return ("it would lock or write rows (FOR UPDATE or SHARE, or INSERT, UPDATE or "
                "DELETE), and a check runs read-only: a checker only reads")
    return None


def _plan_nodes(node: Mapping[str, Any]) -> set[str]:
    found = {str(node["Node Type"])}
    for child in node.get("Plans", ()):
        found |= _plan_nodes(child)
    return found


def sql_checker_ready(conn: Connection, schema: str) -> bool:
    """Whether the checker role and its function exist (``outbox db upgrade --create-roles``)."""
    return bool(conn.execute(query("sql_checker_ready", schema)).scalar_one())


def run_sql_checker(conn: Connection, schema: str, statement: str, message: Message) -> Any:
    """Run a SQL checker as the checker role, in the open (read-only) transaction; the first
    column of its first row, as text (None if no row). Reset the connection afterwards."""
    prepare_sql_checker(conn, schema, statement)
    params = {
        "statement": CHECKER_STATEMENT,
        "id": message.id,
        "producer_group": message.producer_group,
        "topic": message.topic,
        "key": None if message.key is None else as_text(message.key),
        "payload": as_text(message.payload),
        "check_count": message.check_count,
    }
    return conn.execute(query("run_sql_checker", schema), params).scalar()


def reset_session(conn: Connection, schema: str) -> None:
    """Forget whatever a check left on its connection's session (advisory locks, prepared
    statements, settings): DISCARD ALL, which runs outside a transaction; then set the
    session's own settings again (:data:`SESSION_SETTINGS`, which DISCARD ALL drops too).

    ``conn`` is left as it was lent: no transaction begun (SQLAlchemy begins one for the
    DISCARD ALL even in AUTOCOMMIT, and the caller's next ``begin()`` raised) and its
    isolation level back."""
    level = conn.get_execution_options().get("isolation_level", conn.default_isolation_level)
    conn.execution_options(isolation_level="AUTOCOMMIT")
    conn.execute(query("reset_session", schema))
    driver = conn.connection.driver_connection
    assert driver is not None  # a live connection: it just ran DISCARD ALL
    set_session(driver, SESSION_SETTINGS)
    conn.rollback()  # ends SQLAlchemy's transaction: nothing to undo in AUTOCOMMIT
    conn.execution_options(isolation_level=level)


@dataclass(frozen=True, slots=True)
class Discarded:
    id: int
    producer_group: str
    topic: str
    key: bytes | None
    check_count: int
    created_at: datetime
    discarded_at: datetime | None
    detail: str | None


def discarded(conn: Connection, schema: str, limit: int) -> list[Discarded]:
    """DISCARDED rows, oldest first, with the op record that discarded them."""
    rows = conn.execute(query("discarded", schema), {"limit": limit})
    return [Discarded(**row._mapping) for row in rows]


def check_backlog(conn: Connection, schema: str, overdue_seconds: float) -> list[dict[str, Any]]:
    """Per producer group: UNKNOWN messages, and those overdue for their check-back."""
    rows = conn.execute(query("check_backlog", schema), {"overdue_seconds": overdue_seconds})
    return [dict(row._mapping) for row in rows]


def console_overreach(conn: Connection, schema: str) -> str | None:
    """The current role's name if it may delete messages or pending rows, else None."""
    row = conn.execute(query("console_overreach", schema)).one()
    return str(row.role) if row.overreaches else None


def begin_snapshot(conn: Connection, schema: str) -> None:
    """Make the transaction just begun read-only, on one snapshot for all its statements."""
    conn.execute(query("begin_snapshot", schema))


def held_messages(conn: Connection, schema: str, *, topic: str | None = None,
                  key: bytes | None = None, limit: int = 200,
                  preview_bytes: int = 200) -> list[dict[str, Any]]:
    """PARKED and DISCARDED messages, newest first, optionally of one topic and key: why
    (``reason``), ``check_count``, ``attempts``, ``payload_bytes`` and a ``preview``."""
    rows = conn.execute(query("held_messages", schema), {
        "topic": topic, "key": key, "limit": limit, "preview_bytes": preview_bytes})
    return [dict(row._mapping) for row in rows]


def delivery_history(conn: Connection, schema: str, window_seconds: float
                     ) -> list[dict[str, Any]]:
    """Per minute since the start of the minute ``window_seconds`` ago (and first, with
    ``minute`` None, all of them): ``delivered`` and ``latency``, the publish-to-ack p50, p95
    and p99 in seconds."""
    rows = conn.execute(query("delivery_history", schema), {"window_seconds": window_seconds})
    return [dict(row._mapping) for row in rows]


def lease_owners(conn: Connection, schema: str) -> list[dict[str, Any]]:
    """Per live owner (and None for free or expired leases): its shards, first expiry."""
    return [dict(row._mapping) for row in conn.execute(query("lease_owners", schema))]


def reconcile_runs(conn: Connection, schema: str, limit: int, run_id: int | None = None
                   ) -> list[dict[str, Any]]:
    """The newest ``limit`` reconciliation runs, or only run ``run_id``."""
    rows = conn.execute(query("reconcile_runs", schema), {"limit": limit, "id": run_id})
    return [dict(row._mapping) for row in rows]
