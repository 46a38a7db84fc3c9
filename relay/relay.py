"""The relay: promotes committed prepare rows to Kafka and writes an op record for each.

One loop: keep shard leases, fetch the next batch of committed rows (id order), send them
all, wait for the broker's acks, then record partition and offset in one statement. A crash
anywhere before that statement leaves the rows pending, so they are sent again: at least
once, never lost. Between batches it sleeps until a NOTIFY or the poll interval.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError
from kafka.producer.future import FutureRecordMetadata
from sqlalchemy import Connection, Engine, create_engine

from outbox import store
from outbox.message import CONTENT_TYPE_HEADER, ID_HEADER
from outbox.migrate import require_current
from outbox.settings import Settings, mask_url
from relay.leases import Leases
from relay.producer import make_producer
from relay.wakeup import Wakeup

log = logging.getLogger("outbox.relay")


class Relay:
    """Run with :meth:`run`; :meth:`stop` (or SIGTERM via the CLI) ends it after the batch."""

    def __init__(self, settings: Settings, producer: KafkaProducer | None = None) -> None:
        settings.require("database_url", "kafka_bootstrap")
        self.settings = settings
        self.schema = settings.schema_name
        self.stopping = threading.Event()
        self.abandon = threading.Event()
        self.delivered = 0
        self._producer = producer
        self._leases = Leases(self.schema, settings.worker_id, settings.relay_lease_seconds)
        self._engine: Engine = create_engine(
            settings.sqlalchemy_url, pool_size=1, max_overflow=0, pool_pre_ping=True
        )

    def stop(self, *, abandon_batch: bool = False) -> None:
        """Ask the loop to end after the current batch, or at once with ``abandon_batch``."""
        self.stopping.set()
        if abandon_batch:
            self.abandon.set()

    def run(self) -> None:
        with self._engine.connect() as conn:
            require_current(conn, self.schema)
            conn.rollback()
        producer = self._producer or make_producer(self.settings)
        wakeup = Wakeup(self.settings.database_url, self.schema)
        log.info(
            "relay %s started: database %s, schema %s, Kafka %s",
            self.settings.worker_id, mask_url(self.settings.database_url), self.schema,
            self.settings.kafka_bootstrap,
        )
        try:
            with self._engine.connect() as conn:
                self._loop(conn, producer, wakeup)
                if not self.abandon.is_set():
                    self._leases.leave(conn)
        finally:
            wakeup.close()
            producer.close(timeout=0 if self.abandon.is_set() else 10)
            self._engine.dispose()
            log.info("relay %s stopped after delivering %d messages",
                     self.settings.worker_id, self.delivered)

    def _loop(self, conn: Connection, producer: KafkaProducer, wakeup: Wakeup) -> None:
        limit = self.settings.relay_batch_size
        poll = self.settings.relay_poll_interval
        promote_at = 0.0  # monotonic time of the next look for due delayed rows
        while not self.stopping.is_set():
            if self._leases.due() or not self._leases.valid:
                gained, lost = self._leases.maintain(conn)
                if gained or lost:
                    log.info("relay %s owns %d shards (+%d -%d)", self.settings.worker_id,
                             len(self._leases.owned), len(gained), len(lost))
                    promote_at = 0.0
            batch: list[store.Deliverable] = []
            owned = self._leases.owned
            if owned:
                with conn.begin():
                    if time.monotonic() >= promote_at:
                        _, next_due_in = store.promote_due(conn, self.schema, owned)
                        promote_at = time.monotonic() + min(poll, next_due_in or poll)
                    batch = store.fetch_deliverable(conn, self.schema, owned, limit)
            if batch:
                self._deliver(conn, producer, batch)
            if len(batch) < limit:
                timeout = max(0.0, min(poll, promote_at - time.monotonic()))
                if wakeup.wait(timeout, self.stopping):
                    promote_at = 0.0  # a new row may be due sooner than we knew

    def _deliver(
        self, conn: Connection, producer: KafkaProducer, batch: list[store.Deliverable]
    ) -> None:
        sent: list[tuple[store.Deliverable, FutureRecordMetadata]] = []
        failed: dict[int, str] = {}
        blocked_keys: set[tuple[str, bytes | None]] = set()
        for row in batch:
            ordering_key = (row.topic, row.key)
            if row.key is not None and ordering_key in blocked_keys:
                continue  # an earlier message of this key failed: keep the key's order
            try:
                future = producer.send(
                    row.topic, value=row.payload, key=row.key, headers=_headers(row)
                )
            except Exception as exc:  # rejected before sending (size, metadata, ...)
                failed[row.id] = f"{type(exc).__name__}: {exc}"
                blocked_keys.add(ordering_key)
                continue
            sent.append((row, future))
        if not self._flush(producer, sent):
            return  # abandoned: the rows stay pending and are sent again later
        acks: list[tuple[int, int, int]] = []
        for row, future in sent:
            if future.succeeded():
                metadata: Any = future.value
                acks.append((row.id, metadata.partition, metadata.offset))
            else:
                failed[row.id] = f"{type(future.exception).__name__}: {future.exception}"
        with conn.begin():
            store.mark_delivered(conn, self.schema, self.settings.worker_id, acks)
            for row_id, error in failed.items():
                store.record_failure(conn, self.schema, [row_id], error)
        self.delivered += len(acks)
        log.debug("delivered %d messages (ids %d..%d)", len(acks), batch[0].id, batch[-1].id)
        if failed:
            first = next(iter(failed.items()))
            log.warning("%d messages not delivered this round, e.g. id %d: %s",
                        len(failed), *first)

    def _flush(self, producer: KafkaProducer,
               sent: list[tuple[store.Deliverable, FutureRecordMetadata]]) -> bool:
        """Wait for every ack; False if told to abandon the batch meanwhile."""
        while True:
            with contextlib.suppress(KafkaTimeoutError):
                producer.flush(timeout=1.0)
            if all(future.is_done for _, future in sent):
                return True
            if self.abandon.is_set():
                return False


def _headers(row: store.Deliverable) -> list[tuple[str, bytes]]:
    return [
        *row.headers,
        (ID_HEADER, str(row.id).encode()),
        (CONTENT_TYPE_HEADER, row.content_type.encode()),
    ]

