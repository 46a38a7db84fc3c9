"""Shard leases: which relay delivers which keys, so several relays keep per-key order.

Keys hash into ``SHARDS`` virtual shards. A keeper thread heartbeats and renews this relay's
leases every third of a lease — also while the main loop waits on a slow broker — and takes
a fair share of free or expired shards. Surplus shards are handed back by the main loop
between batches, never while a batch of theirs is in flight. A relay killed with -9 loses
its shards when their leases expire; its next owner reads the topic's tail before sending
those shards' messages (relay/recovery.py): a shard is *unsettled* until then. A pass of
this relay that fails leaves the messages it sent and did not record *in doubt*: their tails
are read before it fetches from any shard again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from outbox import store
from outbox.exceptions import ConfigurationError, first_line, setup_error
from outbox.relay import metrics
from outbox.schema import SHARDS
from outbox.settings import RelaySettings

log = logging.getLogger("outbox.relay")
#: How long a session ended by :meth:`WorkerIdentity._claim` may take to let its lock go.
LOST_SESSION_EXIT_SECONDS = 5.0
#: How long a relay abandoning its work waits for the database to take its leases back
#: (:meth:`Leases.abandon`); then they end as a dead relay's do.
ABANDON_WAIT_SECONDS = 2.0
#: libpq's bounds of that hand-back's connection: to connect, and for the server to answer.
ABANDON_CONNECT_ARGS = {"connect_timeout": round(ABANDON_WAIT_SECONDS),
                        "tcp_user_timeout": round(ABANDON_WAIT_SECONDS * 1000)}
#: The least wait between two ticks that wait for another relay's lease to end.
CLAIM_RETRY_SECONDS = 0.2


class Leases:
    """This relay's view of its shards; safe to use from the keeper and the main loop."""

    def __init__(self, schema: str, worker_id: str, lease_seconds: float) -> None:
        self.schema = schema
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._owned: frozenset[int] = frozenset()
        self._surplus: frozenset[int] = frozenset()
        #: owned shards whose sends may be unrecorded: not fetched until their tail is read
        self._unsettled: frozenset[int] = frozenset()
        #: ids of messages a failed pass sent and did not record: no shard is fetched from
        #: until their tails are read (none is in flight meanwhile)
        self._doubted: frozenset[int] = frozenset()
        self._valid_until = 0.0
        #: monotonic time another relay's lease ends, when this relay wants more shards
        #: (None: no sooner than the next renewal)
        self._claim_at: float | None = None
        #: relays alive at the last heartbeat, this one included
        self.live = 1
        #: set when this relay takes shards, has some to hand back, or has its lapsed leases
        #: back (the main loop, waiting for a notification, wakes on it too)
        self.changed = threading.Event()

    @property
    def valid(self) -> bool:
        """True while our leases certainly have not expired (with a safety margin)."""
        return time.monotonic() < self._valid_until

    @property
    def owned(self) -> frozenset[int]:
        """Every shard held, those about to be handed back included."""
        with self._lock:
            return self._owned

    @property
    def active(self) -> frozenset[int]:
        """The shards to fetch from: owned and not about to be handed back."""
        with self._lock:
            return self._owned - self._surplus

    @property
    def surplus(self) -> frozenset[int]:
        return self._surplus

    @property
    def unsettled(self) -> frozenset[int]:
        """Active shards to read the tail of before delivering them."""
        with self._lock:
            return (self._owned - self._surplus) & self._unsettled

    @property
    def doubted(self) -> frozenset[int]:
        """Ids of messages to look for in their tails before delivering any shard."""
        return self._doubted

    @property
    def deliverable(self) -> frozenset[int]:
        """Active shards whose earlier sends are all recorded: safe to fetch from."""
        with self._lock:
            return frozenset() if self._doubted else \
                self._owned - self._surplus - self._unsettled

    def tick(self, conn: Connection, in_flight: int = 0,
             paused: tuple[float, str] | None = None) -> None:
        """Heartbeat, renew and claim in one transaction; note any surplus to shed."""
        started = time.monotonic()
        with conn.begin():
            live = self.live = store.heartbeat(conn, self.schema, self.worker_id,
                                               self.lease_seconds, in_flight, paused)
            mine = store.renew_leases(conn, self.schema, self.worker_id, self.lease_seconds)
            share = math.ceil(SHARDS / max(live, 1))
            claimed: dict[int, bool] = {}
            if len(mine) < share:
                claimed = store.claim_leases(
                    conn, self.schema, self.worker_id, self.lease_seconds, share - len(mine)
                )
                mine |= set(claimed)
            ends_in = store.next_lease_expiry(conn, self.schema, self.worker_id) \
                if len(mine) < share else None
        with self._lock:
            before = self._owned
            lapsed = time.monotonic() >= self._valid_until  # the loop may be waiting them out
            self._owned = frozenset(mine)
            # renewed but not known: a previous process with this worker id held them
            dirty = (self._owned - before - set(claimed)) | {
                shard for shard, clean in claimed.items() if not clean}
            self._unsettled = (self._unsettled | dirty) & self._owned
            self._surplus = frozenset(sorted(mine)[share:])
            self._valid_until = started + self.lease_seconds * 0.8
            self._claim_at = None if ends_in is None else started + ends_in
        if self._owned - before or self._surplus or (lapsed and self._owned):
            self.changed.set()
        if before != self._owned:
            log.info("relay %s owns %d shards (+%d -%d, %d to settle) of %d relays",
                     self.worker_id, len(self._owned), len(self._owned - before),
                     len(before - self._owned), len(self._unsettled), live)
        metrics.OWNED_SHARDS.set(len(self._owned))

    def next_tick_in(self, interval: float) -> float:
        """Seconds until the keeper ticks again: ``interval``, or sooner when a lease of
        another relay ends first (one abandoned by a relay that stopped without waiting for
        its sends is claimed as it ends, not up to a third of a lease later)."""
        claim_at = self._claim_at
        if claim_at is None:
            return interval
        return min(interval, max(CLAIM_RETRY_SECONDS, claim_at - time.monotonic() + 0.05))

    def doubt(self, ids: Iterable[int] | None) -> None:
        """A pass failed: ``ids`` were sent and not recorded (some may be in Kafka); None
        when that is not known, and every shard's tail is read again."""
        with self._lock:
            if ids is None:
                self._unsettled = self._owned
            else:
                self._doubted |= frozenset(ids)

    def settled(self, conn: Connection, shards: frozenset[int],
                doubted: frozenset[int] = frozenset()) -> None:
        """The tails of ``shards`` and of the ``doubted`` messages were read and what they
        held recorded. (A shard settled of its doubts only keeps its ``settled_at``: an
        older bound is still true.)"""
        if shards:
            with conn.begin():
                store.settle_leases(conn, self.schema, self.worker_id, sorted(shards))
        with self._lock:
            self._unsettled -= shards
            self._doubted -= doubted

    def _unsettled_of(self, shards: frozenset[int]) -> list[int]:
        """Of ``shards`` handed back, those whose next owner reads the tail first: unsettled,
        or any while messages are in doubt (their shards are not known here)."""
        return sorted(shards if self._doubted else self._unsettled & shards)

    def shed(self, conn: Connection) -> None:
        """Hand the surplus shards back (call only with no batch of theirs in flight)."""
        with self._lock:
            surplus = self._surplus
        if not surplus:
            return
        with conn.begin():
            store.release_leases(conn, self.schema, self.worker_id, sorted(surplus),
                                 self._unsettled_of(surplus))
        with self._lock:
            self._owned -= surplus
            self._unsettled -= surplus
            self._surplus = frozenset()
        log.info("relay %s handed back %d shards", self.worker_id, len(surplus))
        metrics.OWNED_SHARDS.set(len(self._owned))

    def leave(self, conn: Connection) -> None:
        with conn.begin():
            store.leave(conn, self.schema, self.worker_id, self._unsettled_of(self._owned))
        self._forget()

    def abandon(self, conn: Connection, grace_seconds: float) -> int:
        """Stopping without waiting for the sends in flight (its producer closed first):
        the leases end ``grace_seconds`` from now at the latest, when none of those sends
        can land any more, and their next owner reads the tails; returns how many shards
        were held. Waits :data:`ABANDON_WAIT_SECONDS` at most for the database."""
        with conn.begin():
            held = store.abandon_leases(conn, self.schema, self.worker_id, grace_seconds,
                                        ABANDON_WAIT_SECONDS)
        self._forget()
        return held

    def _forget(self) -> None:
        with self._lock:
            self._owned = self._surplus = self._unsettled = self._doubted = frozenset()
            self._valid_until = 0.0
        metrics.OWNED_SHARDS.set(0)


class TwinWorker(ConfigurationError):
    """Another live relay already runs with this worker id in this schema."""


class WorkerIdentity:
    """This relay's worker id, held by one live process at a time: a session advisory lock on
    an autocommit connection of its own (no transaction stays open), released when the
    process stops or dies."""

    def __init__(self, settings: RelaySettings) -> None:
        self._settings = settings
        #: this process's lock sessions are named so, to tell one it lost from a twin's
        self.session_name = f"outbox-relay:{settings.worker_id[:32]}:{uuid.uuid4().hex[:12]}"
        self._engine = store.engine(settings.sqlalchemy_url, poolclass=NullPool,
                                    connect_args={"application_name": self.session_name})
        self._conn: Connection | None = None

    def hold(self) -> None:
        """Take the id, or check it is still ours (after PostgreSQL restarted, or the
        connection was lost, take it again); raises :class:`TwinWorker` if another live
        process has it."""
        if self._conn is not None:
            try:
                self._conn.exec_driver_sql("SELECT 1")
                return
            except DBAPIError:
                self._close()  # its lock goes with its session
        conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        schema, worker_id = self._settings.schema_name, self._settings.worker_id
        if not self._claim(conn):
            conn.close()
            raise TwinWorker(
                f"another live relay already uses worker id {worker_id!r} in schema {schema}: "
                "give each relay its own OUTBOX_WORKER_ID (or leave it unset: the default is "
                "unique per process)")
        self._conn = conn

    def _claim(self, conn: Connection) -> bool:
        """Take the lock; if this process's own lost session still holds it, end that first
        (it lets go as its backend exits)."""
        schema, worker_id = self._settings.schema_name, self._settings.worker_id
        if store.claim_worker_id(conn, schema, worker_id):
            return True
        if not store.end_lost_sessions(conn, schema, self.session_name):
            return False
        log.warning("relay %s: its worker-id lock was still held by a session of its own whose "
                    "connection was lost; ended that session", worker_id)
        deadline = time.monotonic() + LOST_SESSION_EXIT_SECONDS
        while not store.claim_worker_id(conn, schema, worker_id):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def release(self) -> None:
        """Let go of the id before closing its session (whose backend exits a moment later:
        a relay started at once would be refused as a twin)."""
        if self._conn is not None:
            with contextlib.suppress(SQLAlchemyError):  # a lost session: its lock went too
                store.release_worker_id(self._conn, self._settings.schema_name,
                                        self._settings.worker_id)
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(DBAPIError):
                self._conn.close()
            self._conn = None


class LeaseKeeper(threading.Thread):
    """Keeps the leases (and the pending-messages gauge) fresh on its own connection."""

    def __init__(self, settings: RelaySettings, leases: Leases,
                 in_flight: Callable[[], int] = lambda: 0,
                 paused: Callable[[], tuple[float, str] | None] = lambda: None) -> None:
        super().__init__(name=f"leases-{leases.worker_id}", daemon=True)
        self._engine = store.engine(settings.sqlalchemy_url, pool_size=1, max_overflow=0,
                                    pool_pre_ping=True)
        self._leases = leases
        self._in_flight = in_flight
        self._paused = paused
        #: a count cut off at half the renewal interval delays a renewal by that at most
        self._backlog = metrics.BacklogGauges(leases.schema, leases.lease_seconds / 6)
        self._halt = threading.Event()
        self._poke = threading.Event()
        #: held for each tick: a step aside waits for the tick in progress
        self._ticking = threading.Lock()
        self._aside = False
        self._failing = False
        self.first_tick = threading.Event()
        #: A setup mistake (e.g. the role may not touch the lease tables): the relay stops.
        self.fatal: BaseException | None = None

    def poke(self) -> None:
        """Tick now: a relay joined or left."""
        self._poke.set()

    def stop(self) -> None:
        self._halt.set()
        self._poke.set()

    def step_aside(self, conn: Connection) -> None:
        """Hand every shard back on ``conn`` (the keeper's own is its loop's), and neither
        heartbeat nor take shards until :meth:`rejoin`."""
        with self._ticking:
            self._aside = True
            self._leases.leave(conn)

    @property
    def aside(self) -> bool:
        """Between :meth:`step_aside` and :meth:`rejoin`."""
        return self._aside

    def rejoin(self) -> None:
        with self._ticking:
            self._aside = False
        self.poke()

    def run(self) -> None:
        interval = self._leases.lease_seconds / 3
        while not self._halt.is_set():
            ticked = False  # on this connection: a failure may be of its session alone
            try:
                with self._engine.connect() as conn:
                    while not self._halt.is_set():
                        with self._ticking:
                            if not self._aside:
                                self._leases.tick(conn, self._in_flight(), self._paused())
                        ticked = True
                        self._backlog.observe(conn)
                        if self._failing:
                            log.info("relay %s: lease renewals work again", self._leases.worker_id)
                            self._failing = False
                        self.first_tick.set()
                        self._poke.wait(self._leases.next_tick_in(interval))
                        self._poke.clear()
            except Exception as exc:
                if setup_error(exc) is not None:
                    self.fatal = exc
                    self.first_tick.set()
                    self._leases.changed.set()  # the main loop raises it, not after its poll
                    break
                self._engine.dispose()
                if ticked:  # its session ended (a server restarted since): a new one, at once
                    continue
                if not self._failing:
                    log.warning("relay %s cannot renew its leases (%s); retrying every %.1fs",
                                self._leases.worker_id, first_line(exc), interval)
                    self._failing = True
                    # unrenewed, they lapse: none is delivered from here (for the alert on
                    # uncovered shards); the next renewal sets the gauge again
                    metrics.OWNED_SHARDS.set(0)
                self._halt.wait(interval)
        self._engine.dispose()
