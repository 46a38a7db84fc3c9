"""Retention: drop whole partitions of history past the window, so a pass costs the same
however many rows it removes.

``message`` and ``op_record`` are partitioned by ranges of message id (revision 0006). A
pass (the relay's pruner thread and ``outbox prune`` run the same one) first creates the
ranges the next ids need, then drops the oldest ranges whose rows are all past the window
(their unfinished messages move to the default partition first), then deletes the default
partition's expired finished rows in bounded batches, and last gives the ranges written to
since the pass before what autovacuum no longer does for them (revision 0011): BRIN summaries
and statistics, without which every read of a window of history reads every range. Every
step is its own short transaction, on a thread and a connection of its own, so the relay's
loop never waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import store
from outbox.exceptions import LOCK_NOT_AVAILABLE, first_line, lock_wait_exceeded, sqlstate
from outbox.settings import PruneSettings, RelaySettings

log = logging.getLogger("outbox.retention")
#: Ranges of ``message`` past which a relay warns once: statements planned over every range
#: cost more with each (BENCHMARKS.md, "Partitions of retained history").
MANY_RANGES = 100
#: New ranges are sized so that the window holds about this many at the rate seen.
RANGES_PER_WINDOW = 24
#: Less history than this says too little about the rate: ranges keep ``partition_size``.
MIN_SPAN_SECONDS = 60.0
#: The first message id the sequence hands out: the range below it, which revision 0006
#: makes on a fresh install, never held a message, and its drop is not reported (every new
#: install's first pass said "dropped 1 partitions older than 72 h").
FIRST_ID = 1


@dataclass
class Pruned:
    """What one retention pass did."""

    partitions: list[store.DroppedPartition] = field(default_factory=list)
    #: Finished messages and op records deleted row by row from the default partitions.
    messages: int = 0
    op_records: int = 0
    #: Ranges of history whose new block ranges were summarized, and of those, analyzed.
    summarized: int = 0
    analyzed: int = 0
    #: Range partitions of ``message`` after the pass.
    ranges: int = 0

    @property
    def kept(self) -> int:
        """Unfinished messages moved out of dropped partitions into the default partition."""
        return sum(partition.kept for partition in self.partitions)

    def summary(self, retention_hours: float) -> str:
        return (f"dropped {len(self.partitions)} partitions older than {retention_hours:g} h "
                f"(kept {self.kept} unfinished messages); pruned {self.messages} messages and "
                f"{self.op_records} op records of the default partition; summarized "
                f"{self.summarized} ranges of history (analyzed {self.analyzed})")


def prune(settings: PruneSettings, stop: threading.Event | None = None, *,
          session: Mapping[str, str] = store.SESSION_SETTINGS) -> Pruned:
    """One retention pass over ``settings.schema_name``, its connection's session set up
    with ``session`` (``outbox prune``'s bounds its wait for a lock)."""
    engine = store.engine(settings.sqlalchemy_url, settings=session, pool_size=1,
                          max_overflow=0)
    try:
        with engine.connect() as conn:
            with conn.begin():
                size = range_size(conn, settings)
                made = store.ensure_partitions(conn, settings.schema_name, size)
            if made and size > settings.partition_size:
                log.info("made %d ranges of %s message ids (partition_size %s): the window of "
                         "%g h holds about %d at the rate seen", made, f"{size:,}",
                         f"{settings.partition_size:,}", settings.retention_hours,
                         RANGES_PER_WINDOW)
            pruned = _drop_partitions(conn, settings, stop)
            _prune_default(conn, settings, pruned, stop)
            _tend_ranges(conn, settings, pruned, stop)
    finally:
        engine.dispose()
    if pruned.partitions or pruned.messages:
        log.info("%s", pruned.summary(settings.retention_hours))
    return pruned


def range_size(conn: Connection, settings: PruneSettings) -> int:
    """Ids per new range: ``partition_size``, or a multiple of it so large that the window
    holds about RANGES_PER_WINDOW ranges at the rate of the history kept (the average over
    the window, so a burst counts for its volume). Every range is planned and locked by the
    statements that read ``message`` by a joined id, so at 1,000 msg/s and 72 h the default
    size would keep 259 of them."""
    span = store.written_span(conn, settings.schema_name)
    if span is None or span[1] < MIN_SPAN_SECONDS:
        return settings.partition_size
    ids, seconds = span
    wanted = ids / seconds * settings.retention_hours * 3600 / RANGES_PER_WINDOW
    return settings.partition_size * max(1, round(wanted / settings.partition_size))


def _drop_partitions(conn: Connection, settings: PruneSettings,
                     stop: threading.Event | None) -> Pruned:
    pruned = Pruned()
    while stop is None or not stop.is_set():
        with conn.begin():
            dropped = store.drop_expired_partition(conn, settings.schema_name,
                                                   settings.retention_hours * 3600)
        if dropped is None:
            break
        if dropped.high > FIRST_ID:
            pruned.partitions.append(dropped)
    return pruned


def _prune_default(conn: Connection, settings: PruneSettings, pruned: Pruned,
                   stop: threading.Event | None) -> None:
    while stop is None or not stop.is_set():
        with conn.begin():
            messages, op_records = store.prune_default(
                conn, settings.schema_name, settings.retention_hours * 3600,
                settings.prune_batch_size)
        pruned.messages += messages
        pruned.op_records += op_records
        if messages < settings.prune_batch_size:
            break


def _tend_ranges(conn: Connection, settings: PruneSettings, pruned: Pruned,
                 stop: threading.Event | None) -> None:
    with conn.begin():
        names = store.history_ranges(conn, settings.schema_name)
    pruned.ranges = sum(name.startswith("message_") for name in names)
    for name in names:
        if stop is not None and stop.is_set():
            return
        with conn.begin():  # one short transaction a range: an ANALYZE holds a snapshot
            done = store.tend_range(conn, settings.schema_name, name)
        pruned.summarized += done in ("summarized", "analyzed")
        pruned.analyzed += done == "analyzed"


class Pruner(threading.Thread):
    """Runs :func:`prune` inside the relay: at start (so the partitions ahead exist), then
    every ``prune_interval`` seconds. Its waits for a lock are bounded as ``outbox
    prune``'s: an operator's transaction holding a range of history exclusively (an ALTER or
    DETACH PARTITION left open) stalled it at its first read, its snapshot held, for as long
    as that lasted, and its session stayed queued after the relay stopped."""

    def __init__(self, settings: RelaySettings) -> None:
        super().__init__(name="pruner", daemon=True)
        self._settings = settings
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        warned = False
        while not self._halt.is_set():
            try:
                ranges = prune(self._settings, self._halt,
                               session=store.SHORT_SESSION_SETTINGS).ranges
                if ranges > MANY_RANGES and not warned:
                    warned = True
                    log.warning(
                        "retention keeps %d ranges of message history (partition_size %s "
                        "ids): a publish from a session that plans generically locks every "
                        "one of them until it commits, and reads of message_state plan over "
                        "all; a larger OUTBOX_PARTITION_SIZE keeps the window to tens of "
                        "ranges (docs/operations.md, Sizing)",
                        ranges, f"{self._settings.partition_size:,}")
            except DBAPIError as exc:
                log.warning("retention pass failed (%s); trying again in %.0fs",
                            self._failure(exc), self._settings.prune_interval)
            self._halt.wait(self._settings.prune_interval)

    def _failure(self, exc: DBAPIError) -> str:
        """Why a pass failed; for a lock not granted in time, who holds the schema's."""
        if sqlstate(exc) != LOCK_NOT_AVAILABLE:
            return first_line(exc)
        try:
            engine = store.engine(self._settings.sqlalchemy_url, poolclass=NullPool)
            try:
                with engine.connect() as conn:
                    holders = store.lock_holders(conn, self._settings.schema_name)
            finally:
                engine.dispose()
        except DBAPIError:
            return first_line(exc)
        return lock_wait_exceeded(self._settings.schema_name, holders)
