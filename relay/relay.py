"""The relay: promotes committed prepare rows to Kafka and writes an op record for each.

The loop is pipelined ``PIPELINE_DEPTH`` batches deep: while Kafka acknowledges batch N, the
relay fetches and sends the next ones, and a recorder thread records N's partitions and
offsets in one statement (with those of the batches after N whose acks have all arrived: one
commit for them all). A crash anywhere
before that statement leaves N's rows pending, so they are sent again: at least once, never
lost. Leases (relay/leases.py) decide which shards — and so which keys — this relay owns.

Faults: a broker that stops acknowledging, or a lost database connection, ends the current
pass; the lifecycle (relay/daemon.py) backs off and starts again from what the database says,
logging the outage once and the recovery once. A record the broker rejects permanently is
retried a bounded number of times, then parked. A topic Kafka does not know, or whose records
it refuses, is held on its own while the others flow (relay/holds.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import psycopg
from kafka.errors import KafkaError, TopicAuthorizationFailedError, UnknownTopicOrPartitionError
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import store
from outbox.encoding import CONTENT_TYPE_HEADER, ID_HEADER
from outbox.exceptions import ServiceUnavailable, describe
from outbox.migrate import require_current, require_writable
from outbox.pooling import refuse_transaction_pooling
from outbox.relay import metrics
from outbox.relay.daemon import Abandoned, Lifecycle
from outbox.relay.holds import PROBE_SECONDS, TopicHolds
from outbox.relay.leases import ABANDON_CONNECT_ARGS, LeaseKeeper, Leases, WorkerIdentity
from outbox.relay.prefetch import Prefetch
from outbox.relay.recovery import Recovery
from outbox.relay.retention import Pruner
from outbox.relay.transport import (
    PIPELINE_DEPTH,
    Delivery,
    Headers,
    Transport,
    UnsendableRecord,
    failure_reason,
    is_permanent,
    make_transport_unless,
    refuses_topic,
)
from outbox.relay.wakeup import BUSY_BEFORE_RISING, Wakeup
from outbox.settings import RelaySettings, mask_url

log = logging.getLogger("outbox.relay")
#: How long acks may lag, none coming in, before the relay says the broker seems unreachable.
SLOW_ACK_SECONDS = 5.0
#: How often a flight waiting for its acks is looked at (``Relay._give_up_stuck_topics``).
LOOK_SECONDS = SLOW_ACK_SECONDS / 2
#: While it delivers without waiting, the relay reads its notifications this often: a relay
#: that joins (or leaves) tells the others so, and a busy relay would otherwise hear it only
#: at its next lease renewal, a third of a lease later.
NOTES_WHILE_BUSY = 0.05
#: Kafka failing this relay's passes for this many lease lengths, while other relays are
#: live, makes it hand them its shards (:meth:`Relay._step_aside_if_cut_off`).
STEP_ASIDE_LEASES = 3


class BrokerTrouble(Exception):
    """Kafka did not acknowledge a batch (unreachable, or retries exhausted)."""


class TopicRefused(BrokerTrouble):
    """Kafka's producer stopped after Kafka refused a topic's records (now held): a new one
    goes on with the other topics at once, no outage."""


class TriedRefused(TopicRefused):
    """As TopicRefused, the refused topic being one held and tried again (relay/holds.py):
    refused again as expected, so the new producer is not worth a line of the log."""


class TopicGone(TopicRefused):
    """Kafka answered for the topics of a batch waiting for its acks and no longer knows some
    of them (deleted): their records would be retried for the whole delivery timeout, every
    topic's batches waiting behind them. A new producer goes on at once; those topics are
    asked about before their next batch, and held (relay/holds.py)."""


@dataclass
class InFlight:
    """A batch handed to the transport, waiting for its acknowledgements."""

    transport: Transport
    rows: list[store.Deliverable]
    #: per row: its delivery, or None if held back
    deliveries: list[Delivery | None] = field(default_factory=list)
    acked: bool = False
    #: the producer refused a keyed record of it before sending, or one sent alone failed
    refused: bool = False
    #: ids of the rows whose outcome is their own: sent alone (each in a request of its own,
    #: see Relay._send), or refused before sending
    alone: set[int] = field(default_factory=set)
    #: the rows' ids, rendered once for the fetches made while it is in flight
    ids: store.IdRanges = field(init=False)

    def __post_init__(self) -> None:
        self.ids = store.IdRanges.of([row.id for row in self.rows])

    @functools.cached_property
    def sent(self) -> list[Delivery]:
        """The deliveries of the rows sent (listed once, on the recorder's thread)."""
        return [delivery for delivery in self.deliveries if delivery is not None]

    def settled(self, timeout: float) -> bool:
        """Whether every record sent has landed or failed, waiting up to ``timeout``."""
        self.acked = self.acked or self.transport.wait(self.sent, timeout)
        return self.acked

    def waiting_topics(self) -> set[str]:
        """The topics of the records sent that have neither landed nor failed yet."""
        return {row.topic for row, delivery in zip(self.rows, self.deliveries, strict=True)
                if delivery is not None and not self.transport.wait([delivery], 0)}


class Relay:
    """Run with :meth:`run`; :meth:`stop` (or SIGTERM via the CLI) ends it after the batch."""

    def __init__(self, settings: RelaySettings, transport: Transport | None = None) -> None:
        settings.require("database_url", "kafka_bootstrap")
        self.settings = settings
        self.schema = settings.schema_name
        self.worker_id = settings.worker_id
        self.lifecycle = Lifecycle(f"relay {self.worker_id}", log,
                                   resumed="delivering again after {seconds:.1f}s",
                                   gauge=metrics.PAUSED)
        self.delivered = 0
        self._transport = transport
        self._engine: Engine = store.engine(
            settings.sqlalchemy_url, settings=store.DELIVERY_SETTINGS, pool_size=2,
            max_overflow=0, pool_pre_ping=True)
        #: the fetch's statements planned once (store.Fetching): the ids, always, and the
        #: messages when one range of history holds them
        self._fetching_engine: Engine = store.engine(
            settings.sqlalchemy_url, settings=store.FETCHING_SETTINGS, pool_size=1,
            max_overflow=0, pool_pre_ping=True)
        self._leases = Leases(self.schema, self.worker_id, settings.relay_lease_seconds)
        self._keeper = LeaseKeeper(settings, self._leases, in_flight=self.in_flight,
                                   paused=lambda: self.lifecycle.paused)
        self._identity = WorkerIdentity(settings)
        self._recovery = Recovery(settings, self.lifecycle.stopping)
        self._stop_timer: threading.Timer | None = None
        self._recorder: Recorder | None = None
        #: what ended the last pass, if Kafka did: the next pass starts a new producer
        self._kafka_failure: BrokerTrouble | None = None
        #: rows rejected permanently in a request shared with others: a broker rejects a
        #: whole record batch for one bad record, so each is sent alone next (set operations
        #: only, from the main loop and the recorder)
        self._suspects: set[int] = set()
        #: topics whose records awaiting acks were given up this pass (see
        #: _give_up_stuck_topics): the flights still holding their records are given up at once
        self._given_up: set[str] = set()

    @property
    def owned_shards(self) -> frozenset[int]:
        return self._leases.active

    @property
    def stopping(self) -> threading.Event:
        return self.lifecycle.stopping

    def stop(self, *, abandon: bool = False) -> None:
        """Ask the loop to end after the current batch, or at once with ``abandon``; a batch
        (or a takeover's tail read) still in hand after ``relay_stop_timeout`` is abandoned."""
        first = not self.stopping.is_set()
        self.lifecycle.stop(abandon=abandon)
        if first and not abandon:
            self._stop_timer = threading.Timer(self.settings.relay_stop_timeout, self._overdue)
            self._stop_timer.daemon = True
            self._stop_timer.start()

    def _overdue(self) -> None:
        if self.lifecycle.abandon.is_set():
            return
        log.warning("relay %s: the work in hand did not finish within %gs of the stop "
                    "(OUTBOX_RELAY_STOP_TIMEOUT); abandoning it: its messages stay pending",
                    self.worker_id, self.settings.relay_stop_timeout)
        self.lifecycle.stop(abandon=True)

    def run(self) -> None:
        refuse_transaction_pooling(self.settings.sqlalchemy_url, f"relay {self.worker_id}")
        with self._engine.connect() as conn:
            require_current(conn, self.schema)
            require_writable(conn, self.schema, mask_url(self.settings.database_url))
        self._identity.hold()
        try:
            self._run()
        finally:
            self._identity.release()
            if self._stop_timer is not None:
                self._stop_timer.cancel()

    def _run(self) -> None:
        try:
            transport = self._producer = self._transport or make_transport_unless(
                self.settings, self.stopping)
        except ServiceUnavailable:  # no broker answered: a stop asked for meanwhile is no error
            if not self.stopping.is_set():
                raise
            log.info("relay %s stopped before Kafka answered", self.worker_id)
            return
        self._holds = TopicHolds(self.settings, transport)
        pruner = Pruner(self.settings)
        log.info("relay %s started: database %s, schema %s, Kafka %s (%s)", self.worker_id,
                 mask_url(self.settings.database_url), self.schema,
                 self.settings.kafka_bootstrap, self.settings.kafka_client)
        pruner.start()
        try:
            self.lifecycle.serve(
                self._passes,
                (BrokerTrouble, DBAPIError, psycopg.Error, ServiceUnavailable), max_wait=5,
                engines=(self._engine, self._fetching_engine))
        except Abandoned:
            log.info("relay %s abandoned its batch in flight; it stays pending", self.worker_id)
        finally:
            self._keeper.stop()
            pruner.stop()
            if self._keeper.ident is not None:
                self._keeper.join(5)
            pruner.join(5)
            self._leave()
            self._producer.close(timeout=0 if self.lifecycle.abandon.is_set() else 10)
            self._engine.dispose()
            self._fetching_engine.dispose()
            self.lifecycle.say_stopped("relay %s stopped after delivering %d messages",
                                       self.worker_id, self.delivered)

    def _leave(self) -> None:
        """Hand the shards back, clean (after a graceful stop)."""
        owned = bool(self._leases.owned)  # none: it stopped before it took any
        if self.lifecycle.abandon.is_set():
            self._abandon_leases(owned)
            return
        try:
            with self._engine.connect() as conn:
                self._leases.leave(conn)
        except DBAPIError as exc:
            if owned:
                log.warning("relay %s could not hand back its shards (%s); they expire in "
                            "%.0fs", self.worker_id, describe(exc),
                            self.settings.relay_lease_seconds)

    def _abandon_leases(self, owned: bool) -> None:
        """After work was abandoned: the shards go as soon as no send of this relay's can
        land any more (:meth:`Leases.abandon`), not after a whole lease (up to an hour). On
        a connection of its own that gives up within seconds: a pooled one may be silent
        (the database away), and a second signal is to stop now."""
        self._producer.close(timeout=0)  # none of its records is sent from here on
        grace = self.settings.kafka_delivery_timeout_ms / 1000
        engine = store.engine(self.settings.sqlalchemy_url, poolclass=NullPool,
                              connect_args=ABANDON_CONNECT_ARGS)
        try:
            with engine.connect() as conn:
                held = self._leases.abandon(conn, grace)
        except DBAPIError as exc:
            if owned:
                log.warning("relay %s could not hand back its shards (%s); they expire in "
                            "%.0fs", self.worker_id, describe(exc),
                            self.settings.relay_lease_seconds)
            return
        finally:
            engine.dispose()
        if held:
            log.info("relay %s: its shards are taken over within %.0fs (the Kafka producer's "
                     "delivery timeout, while a send of its may still land), their tails "
                     "read first", self.worker_id, min(grace, self.settings.relay_lease_seconds))

    def _passes(self) -> None:
        """Passes until one fails, or returns; one a held topic's refusal ended (the
        producer stopped) is followed by the next at once."""
        while not self.stopping.is_set():
            self._step_aside_if_cut_off()
            transport = self._working_transport()
            if self._keeper.aside:  # a new producer reached Kafka
                self._keeper.rejoin()
                log.warning("relay %s: Kafka answers it again; it takes a share of the shards",
                            self.worker_id)
            try:
                return self._serve(transport)
            except TopicRefused:
                pass

    def _step_aside_if_cut_off(self) -> None:
        """Kafka has failed this relay's passes for ``STEP_ASIDE_LEASES`` lease lengths, and
        other relays are live: they may reach Kafka (the network between this relay and the
        brokers cut, a firewall rule, a broken route), and its shards' messages would wait
        for it alone. It hands them its shards, after closing its producer (none of its
        sends lands from here on; their next owners read the tails first), and takes none
        until a new producer reaches Kafka."""
        failure = self._kafka_failure
        if self._keeper.aside or self._transport is not None or failure is None \
                or isinstance(failure, TopicRefused) or self._leases.live < 2 \
                or self.lifecycle.outage_seconds < STEP_ASIDE_LEASES * self._leases.lease_seconds:
            return
        held = len(self._leases.active)
        self._producer.close(timeout=0)
        with self._engine.connect() as conn:
            self._keeper.step_aside(conn)
        log.warning("relay %s: Kafka has failed its deliveries for %.0fs (%s) while %d other "
                    "relays are live; handed them its %d shards, and takes a share again once "
                    "Kafka answers it", self.worker_id, self.lifecycle.outage_seconds,
                    describe(failure), self._leases.live - 1, held)

    def _working_transport(self) -> Transport:
        """The transport for the next pass: a new one if the last one's producer broke, or
        if Kafka failed the last pass. (kafka-python's producer, having expired records it
        had sent once, drops its producer id and may never send again: seen when a topic
        was deleted under it.)"""
        failure = self._kafka_failure
        if self._transport is not None or not (failure or self._producer.broken()):
            return self._producer
        fresh = make_transport_unless(self.settings, self.stopping)  # none: the next pass
        if self.lifecycle.in_outage or isinstance(failure, TriedRefused):  # no line per retry
            log.debug("relay %s: started a new Kafka producer after %s", self.worker_id,
                      describe(failure) if failure else "it stopped")
        elif failure is None or (self._producer.broken()
                                 and not isinstance(failure, TopicRefused)):
            log.warning("relay %s: Kafka's producer stopped after an error it cannot go on "
                        "from; started a new one", self.worker_id)
        else:
            log.info("relay %s: started a new Kafka producer after %s", self.worker_id,
                     describe(failure))
        self._kafka_failure = None
        self._producer.close(timeout=0)
        self._producer = fresh
        self._holds.use(fresh)
        return fresh

    def _serve(self, transport: Transport) -> None:
        """One pass: deliver until stopped, or until the broker or the database fails."""
        if self.stopping.is_set():
            return
        self._identity.hold()  # after an outage: still ours, or taken back
        self._given_up = set()
        wakeup = Wakeup(self.settings.sqlalchemy_url, self.schema)
        if self._keeper.ident is None:
            # LISTEN first: the others answer our first heartbeat with a NOTIFY.
            self._keeper.start()
        recorder = self._recorder = Recorder(self.settings, self._await_acks, self._settle)
        recorder.start()
        failed = False
        try:
            with _autocommit(self._engine) as conn, \
                    _autocommit(self._fetching_engine) as fetching:
                self._loop(conn, store.Fetching(fetching, self.schema), transport, wakeup,
                           recorder)
                recorder.drain()
                recorder.raise_failure()
        except BaseException as exc:
            failed = True
            if isinstance(exc, BrokerTrouble):
                self._kafka_failure = exc
            raise
        finally:
            closed = recorder.close()
            wakeup.close()
            if failed:  # acks may have arrived unrecorded: read those messages' tails
                self._leases.doubt(recorder.unrecorded() if closed else None)

    def _loop(self, conn: Connection, fetching: store.Fetching, transport: Transport,
              wakeup: Wakeup, recorder: Recorder) -> None:
        ahead = Prefetch(f"prefetch-{self.worker_id}")
        try:
            self._deliver(conn, fetching, transport, wakeup, recorder, ahead)
        finally:
            ahead.close()  # before the fetching connection closes

    def _deliver(self, conn: Connection, fetching: store.Fetching, transport: Transport,
                 wakeup: Wakeup, recorder: Recorder, ahead: Prefetch) -> None:
        limit, batch_bytes = self.settings.relay_batch_size, self.settings.relay_batch_bytes
        poll = self.settings.relay_poll_interval
        promote_at = 0.0  # monotonic time of the next look for due delayed rows
        woken = False  # by a notification, since the last fetch
        busy_since = 0.0  # monotonic time of the first of the non-empty fetches in a row
        notes_at = 0.0  # monotonic time to read notifications, while delivering
        self._keeper.first_tick.wait(self.settings.relay_lease_seconds)
        while not self.stopping.is_set():
            if self._keeper.fatal is not None:
                raise self._keeper.fatal
            recorder.raise_failure()
            self._leases.changed.clear()  # the shards read below are the newest
            if self._leases.surplus:
                recorder.drain()  # never hand back a shard with a batch in flight
                recorder.raise_failure()
                self._leases.shed(conn)
            if self._leases.valid:
                self._recovery.settle(conn, self._leases)
            shards = self._leases.deliverable if self._leases.valid else frozenset()
            batch: list[store.Deliverable] = []
            saw_all = False  # the fetch returned every deliverable row it could see
            if shards:
                self._holds.revisit(conn, shards)
            if shards and recorder.wait_for_room(PIPELINE_DEPTH):
                with conn.begin():
                    if time.monotonic() >= promote_at:
                        _, next_due_in = store.promote_due(conn, self.schema, shards)
                        promote_at = time.monotonic() + min(poll, next_due_in or poll)
                    held = self._holds.topics
                    batch = ahead.take(shards, held) or store.fetch_deliverable(
                        conn, self.schema, shards, limit, in_flight=recorder.in_flight_ids(),
                        max_bytes=batch_bytes, held=held, fetching=fetching)
                saw_all = len(batch) < limit and _payload_bytes(batch) < batch_bytes
                batch = self._holds.admit(conn, shards, batch)
            if woken:
                wakeup.found_work(bool(batch))
                woken = False
            if not batch and shards and self.lifecycle.in_outage \
                    and not recorder.in_flight_count():
                # the database answers and no batch awaits an ack: an outage that ended while
                # there was nothing to deliver is over too (else the next one goes unsaid)
                self.lifecycle.recovered()
            now = time.monotonic()
            busy_since = (busy_since or now) if batch else 0.0
            if wakeup.asleep_on != shards or (batch and now - busy_since >= BUSY_BEFORE_RISING):
                wakeup.rise()  # delivering without a pause, or asleep on shards not its own
            if batch:
                metrics.topics_seen(row.topic for row in batch)
                flight = InFlight(transport, batch)
                if transport.fetch_ahead and not saw_all \
                        and recorder.unsettled() < PIPELINE_DEPTH - 1:
                    # a backlog, and room for the next batch once this one is in: it is fetched
                    # while this one is sent (with the pipeline full, the loop would wait for
                    # room anyway, and the fetch would only compete with the send)
                    self._fetch_ahead(ahead, fetching, shards, recorder, flight)
                try:
                    self._send(flight)
                except BaseException:
                    recorder.doubt(row.id for row in batch)  # some may have been sent
                    raise
                recorder.submit(flight)
                if flight.refused:
                    ahead.drop()  # fetched past the rows held back (see _send)
                    recorder.drain()  # see _send
                if not (saw_all and wakeup.asleep_on):
                    if now >= notes_at:  # fetching again at once: no commit's note is lost
                        notes_at = now + NOTES_WHILE_BUSY
                        if self._heed(wakeup.drain()):
                            promote_at = 0.0
                    continue
                # Asleep since before the fetch: every commit it could not see notifies, so
                # fetching again now would find nothing (a round trip and a core's time each
                # wake-up, under a trickle).
            elif shards and not wakeup.asleep_on:
                # publishers did not notify while it was awake: fetch once more, asleep
                notes = wakeup.fall_asleep(shards)
                if notes is not None and self._heed(notes):
                    promote_at = 0.0
                continue
            due = min(promote_at, self._holds.next_at) - time.monotonic() if shards else poll
            notes = wakeup.wait(max(0.0, min(poll, due)), self.stopping, self._leases.changed)
            woken = bool(notes)
            if wakeup.waited:
                busy_since = 0.0  # a pause: not delivering without one
            if self._heed(notes):
                promote_at = 0.0

    def _heed(self, notes: set[str]) -> bool:
        """Acts on notifications; True when a new delayed row may be due sooner than known."""
        if "rebalance" in notes:
            self._keeper.poke()
        return store.DELAYED_NOTE in notes

    def _fetch_ahead(self, ahead: Prefetch, fetching: store.Fetching, shards: frozenset[int],
                     recorder: Recorder, flight: InFlight) -> None:
        """Starts fetching the batch after ``flight`` (relay/prefetch.py), on the fetching
        connection alone, with the ids in flight as they will be once it is submitted."""
        in_flight = store.IdRanges.joined((recorder.in_flight_ids(), flight.ids))
        held = self._holds.topics  # as after this batch's admit: topics it held are left out
        limit, batch_bytes = self.settings.relay_batch_size, self.settings.relay_batch_bytes
        ahead.start(functools.partial(
            store.fetch_deliverable, fetching.conn, self.schema, shards, limit,
            in_flight=in_flight, max_bytes=batch_bytes, held=held, fetching=fetching),
            shards, held)

    def _send(self, flight: InFlight) -> None:
        """Hands the flight's rows to the transport in id order. A keyed row the producer
        refuses before sending holds back the rest of its key in the batch (they stay
        pending), and the flight is marked ``refused``: the loop then fetches again only once
        every flight is recorded, so the refused row leads its key's next batch. (A batch
        fetched while it was in flight would skip it and the rows held back behind it.)

        A suspect (rejected before in a request with others) is sent alone, between two
        flushes, so its outcome is its own; if it fails, the rest of the batch is held back
        (a producer may be unusable after a rejection)."""
        transport, batch = flight.transport, flight.rows
        blocked: set[tuple[str, bytes]] = set()
        lost: set[str] = set()  # topics the producer lost the metadata of
        stopped = False
        for row in batch:
            delivery: Delivery | None = None
            if not stopped and (row.key is None or (row.topic, row.key) not in blocked) \
                    and row.topic not in lost:
                suspect = row.id in self._suspects
                try:
                    headers = _headers(row)
                except store.UnpairedHeaders as exc:
                    delivery = transport.unsent(UnsendableRecord(f"message {row.id}: {exc}"))
                else:
                    delivery = self._send_alone(transport, row, headers) if suspect else \
                        transport.send(row.topic, row.key, row.payload, headers)
                if delivery.error is not None:  # refused before sending, or failed alone
                    flight.alone.add(row.id)
                    stopped = suspect
                    if row.key is not None:
                        blocked.add((row.topic, row.key))
                    if isinstance(delivery.error, UnknownTopicOrPartitionError):
                        lost.add(row.topic)  # deleted? the next batch asks Kafka first
                elif suspect:
                    flight.alone.add(row.id)
            flight.deliveries.append(delivery)
        if lost:
            self._holds.lost(lost)
        flight.refused = bool(blocked) or stopped or bool(lost)
        metrics.BATCH_SIZE.observe(len(batch))

    def _send_alone(self, transport: Transport, row: store.Deliverable, headers: Headers
                    ) -> Delivery:
        """Sends ``row`` between two flushes, each waiting ``SLOW_ACK_SECONDS`` at most (a
        broker that does not answer fails the pass through the acks, not here)."""
        with contextlib.suppress(KafkaError):  # kafka-python: not flushed in time
            transport.flush(SLOW_ACK_SECONDS)
        delivery = transport.send(row.topic, row.key, row.payload, headers)
        with contextlib.suppress(KafkaError):
            transport.flush(SLOW_ACK_SECONDS)
        return delivery

    def _settle(self, conn: Connection, flights: list[InFlight], salvaging: bool = False
                ) -> None:
        """Record batches whose acks have all arrived (the recorder waited for them) in one
        transaction; raises BrokerTrouble if Kafka failed (unless ``salvaging``: a failure
        already ends the pass, and the acks that did arrive are still recorded, so the next
        pass does not send those messages again)."""
        acks: list[tuple[int, int, int]] = []
        failures: list[store.Failure] = []
        refusals: list[store.Failure] = []  # not the messages' fault: their topics are held
        refused: dict[str, str] = {}  # topic -> the error (relay/holds.py)
        blamed: dict[int, str] = {}  # id() of a refusal's error -> the topic it holds
        tried, landed = self._holds.tried, set()
        rejected: set[int] = set()  # rejected permanently, beside others: not yet counted
        for flight in flights:
            for row, delivery in zip(flight.rows, flight.deliveries, strict=True):
                if delivery is None:
                    continue
                if delivery.error is None:
                    acks.append((row.id, delivery.partition, delivery.offset))
                    if tried and row.topic in tried:
                        landed.add(row.topic)
                    continue
                if refuses_topic(delivery.error):
                    topic = refused_topic(delivery.error, row.topic, flights, blamed,
                                          tried | set(self._holds.topics))
                    refused[topic] = describe(delivery.error)
                    if row.topic not in tried:  # a held topic's rows keep their 'held: ' mark
                        refusals.append(store.Failure(row.id, refused[topic], False))
                    continue
                permanent = is_permanent(delivery.error)
                if permanent and row.id not in flight.alone:
                    # maybe only the neighbour of a bad record: not counted towards
                    # parking, and sent alone next time
                    self._suspects.add(row.id)
                    rejected.add(row.id)
                    permanent = False
                failures.append(store.Failure(row.id, failure_reason(delivery.error,
                                                                     self.settings), permanent))
        if salvaging:  # the pass failed already: not these rows' own (kafka-python fails
            failures = refusals = []  # the records after a refusal with the same error)
            refused = {}
        if self._suspects:
            self._suspects.difference_update(message_id for message_id, _, _ in acks)
        with conn.begin():
            closed = store.mark_delivered(conn, self.schema, self.worker_id, acks)
            parked = store.record_failures(conn, self.schema, self.worker_id,
                                           failures + refusals,
                                           self.settings.relay_max_attempts)
        self.delivered += len(closed)
        for topic, count in Counter(topic for topic, _ in closed).items():
            metrics.DELIVERED.labels(topic).inc(count)
        metrics.LATENCY.observe_all(latency for _, latency in closed)
        for message_id, topic in parked:
            self._suspects.discard(message_id)
            metrics.PARKED.labels(topic).inc()
            reason = next(f.error for f in failures if f.id == message_id)
            log.error("message %d to topic %s parked after %d permanent rejections: %s "
                      "(resume it with `outbox resume %d`)", message_id, topic,
                      self.settings.relay_max_attempts, reason, message_id)
        for topic, error in refused.items():
            self._holds.refused(topic, error)
        if landed:
            self._holds.landed(landed)
        transient = [f for f in failures if not f.permanent]
        if acks and not transient and not salvaging:  # else the pass fails: the outage goes on
            self.lifecycle.recovered()
        for failure in failures:  # a suspect's rejection is permanent, not the broker's
            metrics.FAILURES.labels("permanent" if failure.permanent or failure.id in rejected
                                    else "retriable").inc()
        if refusals:
            metrics.FAILURES.labels("refused").inc(len(refusals))
        if transient:
            # a deleted topic fails as a broker away does: the next batch asks Kafka about
            # these topics before sending to them (relay/holds.py)
            self._holds.lost({row.topic for flight in flights
                              for row, delivery in zip(flight.rows, flight.deliveries, strict=True)
                              if delivery is not None and delivery.error is not None})
            raise BrokerTrouble(f"{len(transient)} messages not acknowledged, e.g. message "
                                f"{transient[0].id}: {transient[0].error}")
        if (failures or refused) and flights[0].transport.broken():
            # a tried topic refused again stops the producer too, though none of its rows
            # is a failure: each record would fail in it from then on, that topic's as well
            if failures or refusals:
                first = (failures or refusals)[0]
                stopped = (f"Kafka's producer stopped after rejecting message {first.id}: "
                           f"{first.error}")
                raise BrokerTrouble(stopped) if failures else TopicRefused(stopped)
            raise TriedRefused("Kafka's producer stopped after Kafka refused the records of "
                               f"held topics tried again: {', '.join(sorted(refused))}")

    def _await_acks(self, flight: InFlight) -> None:
        """Waits for the flight's acks. A producer settles every record within its delivery
        timeout; one that has not after twice that is wedged (kafka-python's, having dropped
        its producer id, expires nothing while it waits for a new one): the pass ends, and
        the next starts a new producer. Acks still coming in after ``SLOW_ACK_SECONDS`` are
        slow, not an outage: it is said at the first look that finds none came since the one
        before (librdkafka's, still landing after 5 s over 3,000 new topics, were said as an
        outage twice in one run, BENCHMARKS.md "Many topics")."""
        started = time.monotonic()
        wedged_after = 2 * self.settings.kafka_delivery_timeout_ms / 1000 + SLOW_ACK_SECONDS
        warned = False
        given_up = self._given_up and {row.topic for row in flight.rows} & self._given_up
        look_at = started + (0 if given_up else LOOK_SECONDS)
        waited_on: set[str] | None = None  # the topics whose records waited at the last look
        draining = False  # at the last look, a topic that waited at the one before had landed
        while not flight.settled(0.25):
            if self.lifecycle.abandon.is_set():
                raise Abandoned
            now = time.monotonic()
            if now - started > wedged_after:
                raise BrokerTrouble(
                    f"Kafka's producer has not settled {len(flight.sent)} records in "
                    f"{wedged_after:.0f}s, past its delivery timeout: it is stuck")
            if now >= look_at:  # on the clock of the send, so the look at 5 s comes first
                look_at = started + LOOK_SECONDS * (1 + (now - started) // LOOK_SECONDS)
                waiting = flight.waiting_topics()
                draining = waited_on is not None and bool(waited_on - waiting)
                waited_on = waiting
                if waiting:
                    self._give_up_stuck_topics(flight, waiting, now - started, draining)
            if not warned and not draining and now - started > SLOW_ACK_SECONDS:
                warned = True
                self.lifecycle.outage(
                    f"Kafka has not acknowledged {len(flight.sent)} messages for "
                    f"{SLOW_ACK_SECONDS:.0f}s (the producer retries for "
                    f"{self.settings.kafka_delivery_timeout_ms / 1000:.0f}s)", since=started)

    def _give_up_stuck_topics(self, flight: InFlight, waiting: set[str], waited: float,
                              draining: bool) -> None:
        """Ends the pass, a new producer going on at once, if Kafka answers while records of
        ``flight`` wait (their topics: ``waiting``): TopicGone if it no longer knows their
        topic (deleted); TopicRefused, the topic held as a refused one, if records of other
        topics sent with or after them have landed meanwhile (a partition without a leader or
        enough in-sync replicas, which the producer retries until its delivery timeout while
        every topic waits behind it), or if it is such a topic tried again. Neither: an
        outage, waited out as before.

        Judged from ``SLOW_ACK_SECONDS`` on, and not while the producer is still getting
        through the flight (``draining``: a topic that waited at the look before had its
        records acknowledged since). librdkafka acknowledged one record in each of 3,000
        topics at about 300 a second, half of them after 5 s (BENCHMARKS.md, "Many topics"),
        and those 1,500 were held as stuck."""
        transport = flight.transport
        if waiting & self._given_up:  # the pass is ending: salvage no more of this batch
            raise TopicRefused(f"records of topic {', '.join(sorted(waiting & self._given_up))}"
                               " given up this pass")
        if waited < SLOW_ACK_SECONDS - LOOK_SECONDS / 2 or draining:  # before the look at 5 s
            return
        try:
            gone = waiting - transport.available(waiting, PROBE_SECONDS)
        except ServiceUnavailable:
            return
        if gone:
            self._given_up |= gone
            self._holds.lost(gone)
            raise TopicGone(f"Kafka no longer knows topic {', '.join(sorted(gone))} (deleted?) "
                            f"while {len(flight.sent)} records of a batch have waited "
                            f"{waited:.1f}s for their acks")
        recorder = self._recorder
        landed = {row.topic for later in (recorder.flights() if recorder else [flight])
                  if later.transport is transport
                  for row, delivery in zip(later.rows, later.deliveries, strict=True)
                  if delivery is not None and delivery.error is None
                  and transport.wait([delivery], 0)}
        # a topic tried again after it was held so (relay/holds.py) needs no other evidence:
        # were Kafka away, the other topics' records would show it next
        stuck = waiting if landed - waiting else waiting & self._holds.tried
        if stuck:
            self._given_up |= stuck
            self._holds.stuck(stuck, waited)
            raise TopicRefused(f"Kafka has not acknowledged the records of topic "
                               f"{', '.join(sorted(stuck))} for {waited:.1f}s" + (
                                   " while it acknowledged other topics' records"
                                   if landed - waiting else ", tried again"))

    def in_flight(self) -> int:
        recorder = self._recorder
        return recorder.in_flight_count() if recorder else 0


class Recorder(threading.Thread):
    """Waits for each sent batch's acks, in order, and records them (``settle``) on its own
    connection, so the main loop can fetch and send the next batches meanwhile. The batches
    after it whose acks have all arrived by then are recorded in the same transaction, up to
    a batch's worth of rows: under a steady trickle each batch holds a few messages, and one
    commit (one WAL flush) apiece made the recorder the queue every message waited in; full
    batches are still recorded one by one, overlapping the sends of the next ones.

    After a failure the main loop raises it to start a new pass, and the recorder still waits
    for the batches already sent and records the acks that arrive (``salvaging``): an outage
    must never make the next pass send again what Kafka already has. Rows whose sends failed
    stay pending and are sent again."""

    def __init__(self, settings: RelaySettings, await_acks: Callable[[InFlight], None],
                 settle: Callable[[Connection, list[InFlight], bool], None]) -> None:
        super().__init__(name=f"recorder-{settings.worker_id}", daemon=True)
        self.engine = store.engine(settings.sqlalchemy_url, settings=store.RECORDING_SETTINGS,
                                   pool_size=1, max_overflow=0, pool_pre_ping=True)
        self._rows_per_record = settings.relay_batch_size
        self._await_acks = await_acks
        self._settle = settle
        self._changed = threading.Condition()
        #: handed over and not yet settled, in order
        self._unsettled: list[InFlight] = []
        #: handed over and not yet taken up by this thread; None asks it to end
        self._waiting: deque[InFlight | None] = deque()
        self._failure: BaseException | None = None
        #: ids of rows sent but not recorded, besides those of ``_unsettled``: failed sends
        #: of the batches salvaged (a send that timed out may have landed all the same)
        self._doubted: set[int] = set()
        #: every send ends (acked or failed) within the producer's delivery timeout
        self._close_timeout = settings.kafka_delivery_timeout_ms / 1000 + 10

    def submit(self, flight: InFlight) -> None:
        self._hand_over(flight)

    def in_flight_ids(self) -> store.IdRanges:
        with self._changed:
            return store.IdRanges.joined(flight.ids for flight in self._unsettled)

    def flights(self) -> list[InFlight]:
        """The batches handed over and not yet settled, in order."""
        with self._changed:
            return list(self._unsettled)

    def unsettled(self) -> int:
        """How many batches are handed over and not yet settled."""
        with self._changed:
            return len(self._unsettled)

    def in_flight_count(self) -> int:
        with self._changed:
            return sum(flight.ids.size for flight in self._unsettled)

    def wait_for_room(self, depth: int) -> bool:
        """Block while ``depth`` batches are unsettled; False if the recorder failed."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._unsettled) < depth or bool(self._failure))
            return self._failure is None

    def drain(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._unsettled or bool(self._failure))

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self) -> bool:
        """Wait until every batch handed over is settled or salvaged; False if it did not
        end in time (what it recorded is then not known)."""
        self._hand_over(None)
        self.join(self._close_timeout)
        return not self.is_alive()

    def doubt(self, ids: Iterable[int]) -> None:
        with self._changed:
            self._doubted.update(ids)

    def unrecorded(self) -> set[int]:
        """The ids of the rows sent and not recorded (call once the thread has ended)."""
        with self._changed:
            return self._doubted.union(
                row.id for flight in self._unsettled
                for row, delivery in zip(flight.rows, flight.deliveries, strict=True)
                if delivery is not None)

    def _hand_over(self, flight: InFlight | None) -> None:
        with self._changed:
            if flight is not None:
                self._unsettled.append(flight)
            self._waiting.append(flight)
            self._changed.notify_all()

    def _next(self) -> InFlight | None:
        with self._changed:
            self._changed.wait_for(lambda: bool(self._waiting))
            return self._waiting.popleft()

    def _acked_after(self, first: InFlight) -> list[InFlight]:
        """The batches handed over next whose acks have all arrived, in order, while they
        and ``first`` hold at most a batch's worth of rows."""
        taken: list[InFlight] = []
        rows = len(first.rows)
        with self._changed:
            while self._waiting and (flight := self._waiting[0]) is not None \
                    and rows + len(flight.rows) <= self._rows_per_record and flight.settled(0):
                rows += len(flight.rows)
                taken.append(flight)
                self._waiting.popleft()
        return taken

    def run(self) -> None:
        try:
            with _autocommit(self.engine) as conn:
                while (flight := self._next()) is not None:
                    flights = [flight]
                    try:
                        self._await_acks(flight)
                        flights += self._acked_after(flight)
                        salvaging = self._failure is not None
                        self._settle(conn, flights, salvaging)
                        if salvaging:
                            self.doubt(row.id for later in flights for row, delivery in
                                       zip(later.rows, later.deliveries, strict=True)
                                       if delivery is not None and delivery.error is not None)
                    except BaseException as exc:
                        # Unrecorded, their rows stay in flight until the pass ends: a
                        # fetch of this pass would send them again, and the next pass's
                        # tail read finds them in Kafka instead.
                        self._failure = self._failure or exc
                        flights = []
                    with self._changed:
                        for settled in flights:
                            self._unsettled.remove(settled)
                        self._changed.notify_all()
        except BaseException as exc:  # could not even connect: the same
            with self._changed:
                self._failure = self._failure or exc
                self._changed.notify_all()
        finally:
            self.engine.dispose()


def refused_topic(error: BaseException, topic: str, flights: list[InFlight],
                  blamed: dict[int, str], held: Collection[str] = ()) -> str:
    """The topic a refusal is about. kafka-python's producer, stopped by one topic's
    refusal, fails the records of the other topics with that same error object: a
    ``TopicAuthorizationFailedError`` names its topic (one of these flights', or a topic
    held or tried again, whose refused records may have been settled in an earlier pass);
    another error is blamed on the first topic found failing with it (``blamed``, by the
    error's identity, in send order)."""
    named = error.args[0] if isinstance(error, TopicAuthorizationFailedError) and error.args \
        else None
    if isinstance(named, str) and (named in held or any(
            row.topic == named for flight in flights for row in flight.rows)):
        return named
    return blamed.setdefault(id(error), topic)


def _autocommit(engine: Engine) -> Connection:
    """A connection whose statements commit one by one: the relay's hot statements (fetch,
    promote, mark delivered) are each one statement, and BEGIN and COMMIT would double their
    round trips. A multi-statement block (``with conn.begin()``) commits each statement."""
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def _payload_bytes(batch: list[store.Deliverable]) -> int:
    return sum(len(row.payload) for row in batch)


def _headers(row: store.Deliverable) -> list[tuple[str, bytes]]:
    """The row's own headers, then ``outbox-id`` and ``content-type`` (built for every
    record the relay sends: kept to the cheapest Python can do); raises
    store.UnpairedHeaders."""
    headers = store.paired_headers(row.header_keys, row.header_values) \
        if row.header_keys or row.header_values else []
    headers.append((ID_HEADER, b"%d" % row.id))
    headers.append((CONTENT_TYPE_HEADER, _encoded(row.content_type)))
    return headers


@functools.lru_cache(maxsize=256)  # content types are few; a bound all the same
def _encoded(content_type: str) -> bytes:
    return content_type.encode()
