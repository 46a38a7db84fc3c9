"""Takeover without duplicates: before delivering shards whose earlier sends may be
unrecorded, read the affected partitions' tails and record what is already there.

A relay killed between Kafka's acknowledgement and its op records leaves messages that are
in the topic but still pending. Its shards' next owner first reads the tails of the
partitions those messages can be on, looks for their ``outbox-id`` headers, and records the
ones it finds as DELIVERED at their true partition and offset, so it does not send them
again. A relay whose own pass failed does the same for the messages that pass sent and did
not record (``Leases.doubted``), and for those only.

*Which partitions*: those of the pending messages' topics (of the shards, or of the
messages in doubt); a keyed message's partition is murmur2(key) (both transports map keys
that way), an unkeyed one may be on any.
*Where a tail starts*: a pending message can only have been sent after it committed and
after its shard was last settled (``relay_lease.settled_at``); every op record written
before that moment was acknowledged before it, so its offset is below the message's. The
tail starts after the highest such offset of the partition (the newest found in a window
walked back from that moment); without one, at the partition's beginning.
*Where it ends*: at the high-watermark a fresh consumer reads: every record the dead relay
got acknowledged is below it. A record is this outbox's message only if its topic, key and
value are the message's too (relay/tails.py). Ids found that are not pending in the shards
this relay holds (another live relay's messages on the same partitions, or ones already
recorded) are left alone. A tail longer than ``relay_tail_max_records`` is not read to its
end: the rest is sent again (duplicates possible), with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from kafka.partitioner.default import murmur2
from sqlalchemy import Connection

from outbox import store
from outbox.relay import metrics
from outbox.relay.leases import Leases
from outbox.relay.tails import Stopped, Tail, TailReader, make_tail_reader, named
from outbox.settings import RelaySettings

log = logging.getLogger("outbox.relay")
#: Windows of op records searched, each further back, for a partition's last recorded offset.
LOOKBACK = (timedelta(seconds=10), timedelta(minutes=10), timedelta(days=1))
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Shards whose pending messages' keys one statement groups (:meth:`Recovery._affected`).
SHARDS_PER_READ = 4
#: A settling reading the tails of this many topics or more says so as it starts.
MANY_TOPICS = 100


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's Java client, kafka-python and librdkafka's murmur2_random pick."""
    return int(murmur2(key) & 0x7FFFFFFF) % partitions


class Recovery:
    """Settles this relay's unsettled shards (see the module's docstring)."""

    def __init__(self, settings: RelaySettings, stop: threading.Event | None = None
                 ) -> None:
        self.settings = settings
        #: set (the relay stops): a settling in progress ends, the shards stay unsettled
        self.stop = stop or threading.Event()
        self.schema = settings.schema_name
        self.actor = f"{settings.worker_id} (recovered)"

    def settle(self, conn: Connection, leases: Leases) -> None:
        """Read the tails of ``leases.unsettled`` and of ``leases.doubted`` and record what
        they hold, then mark them settled; raises ServiceUnavailable (or a database error)
        if it cannot."""
        shards, doubted = leases.unsettled, leases.doubted
        if not shards and not doubted:
            return
        started = time.monotonic()
        what = " and ".join(
            ([f"{len(shards)} shards"] if shards else [])
            + ([f"the {len(doubted)} messages a failed pass left unrecorded"] if doubted
               else []))
        reader = make_tail_reader(self.settings, self.stop)
        try:
            tail, topics = self._read(conn, reader, shards, doubted, what)
        except Stopped:
            log.info("relay %s stopped while it settled %s; they stay unsettled for their "
                     "next owner", self.settings.worker_id, what)
            return
        finally:
            reader.close()
        # Messages in doubt are settled before this pass fetches anything (Leases.deliverable):
        # no shard has a batch in flight, and any found may be recorded. Those of shards about
        # to be handed back too: no longer in doubt, they go back clean (Leases.shed).
        recovered = self._record(conn, tail, leases.owned if doubted else shards)
        leases.settled(conn, shards, doubted)
        metrics.TAIL_RECORDS.inc(tail.records)
        metrics.RECOVERED.inc(recovered)
        log.info("relay %s settled %s in %.2fs: read %d records of the tails of %d topic%s, "
                 "%d messages were already in Kafka and are recorded now",
                 self.settings.worker_id, what, time.monotonic() - started,
                 tail.records, topics, "" if topics == 1 else "s", recovered)

    def _read(self, conn: Connection, reader: TailReader, shards: frozenset[int],
              doubted: frozenset[int], what: str) -> tuple[Tail, int]:
        """What the tails of the topics of the shards' pending messages and of the messages
        in doubt hold, and how many topics that is."""
        tail = Tail()
        affected = self._affected(conn, reader, shards, doubted)
        if len(affected) >= MANY_TOPICS:
            log.info("relay %s: settling %s, reading the tails of %d topics",
                     self.settings.worker_id, what, len(affected))
        for starts in self._reads(conn, affected, reader.partitions_per_read):
            part = reader.read(starts, self.settings.relay_tail_max_records - tail.records)
            tail.records += part.records
            tail.found.update(part.found)
            if not part.complete:
                tail.complete = False
                log.warning("relay %s: the tails read to settle %s reached %d records in "
                            "%s (OUTBOX_RELAY_TAIL_MAX_RECORDS); the messages beyond it, and "
                            "those of the topics not read yet, are sent again (duplicates "
                            "possible)", self.settings.worker_id, what,
                            self.settings.relay_tail_max_records, named(starts))
                break
        return tail, len(affected)

    def _reads(self, conn: Connection, affected: dict[str, tuple[set[int], datetime]],
               most: int) -> Iterator[dict[tuple[str, int], int | None]]:
        """The affected partitions' starts, a read's worth at a time: whole topics, up to
        ``most`` partitions (or one topic with more)."""
        chunk: dict[str, tuple[set[int], datetime]] = {}
        size = 0  # the chunk's partitions
        for topic, found in affected.items():
            if chunk and size + len(found[0]) > most:
                yield self._starts(conn, chunk)
                chunk, size = {}, 0
            chunk[topic] = found
            size += len(found[0])
        if chunk:
            yield self._starts(conn, chunk)

    def _heed_stop(self) -> None:
        if self.stop.is_set():
            raise Stopped

    def _affected(self, conn: Connection, reader: TailReader, shards: frozenset[int],
                  doubted: frozenset[int]) -> dict[str, tuple[set[int], datetime]]:
        """Per topic: the partitions the pending messages of the shards, and those in doubt,
        can be on, and the earliest moment one of them can have been sent."""
        counts: dict[str, int] = {}  # partitions per topic
        partitions: dict[str, set[int]] = {}
        earliest: dict[str, datetime] = {}
        for candidates in self._candidates(conn, sorted(shards), sorted(doubted)):
            for topic, key, sent_after in candidates:
                count = counts.get(topic)
                if count is None:
                    self._heed_stop()
                    count = counts[topic] = reader.partitions(topic)
                if count == 0:
                    continue  # no such topic: nothing can have landed
                partitions.setdefault(topic, set()).update(
                    range(count) if key is None else (partition_of(key, count),))
                earliest[topic] = min(earliest.get(topic, sent_after), sent_after)
        return {topic: (found, earliest[topic]) for topic, found in partitions.items()}

    def _candidates(self, conn: Connection, shards: list[int], doubted: list[int]
                    ) -> Iterator[list[tuple[str, bytes | None, datetime]]]:
        """``(topic, key, sent after)`` of the shards' pending messages, then of the pending
        messages in doubt; each batch is folded in before the next is read.

        ``SHARDS_PER_READ`` shards at a time: one statement grouping a long backlog's keys
        spilled to disk, past a role's ``temp_file_limit`` (53400, retried for ever: the
        relay delivered nothing, and neither did the next one), and kept a tuple per key in
        the relay."""
        for start in range(0, len(shards), SHARDS_PER_READ):
            self._heed_stop()
            with conn.begin():  # ended before the caller asks Kafka about their topics
                candidates = store.unrecorded_candidates(conn, self.schema,
                                                         shards[start:start + SHARDS_PER_READ])
            yield candidates
        if doubted:
            self._heed_stop()
            with conn.begin():
                candidates = store.doubted_candidates(conn, self.schema, doubted)
            yield candidates

    def _starts(self, conn: Connection, affected: dict[str, tuple[set[int], datetime]]
                ) -> dict[tuple[str, int], int | None]:
        """Per partition of the topics, the offset after the last one recorded before the
        topic's moment: in windows further and further back, all topics in one statement
        each."""
        self._heed_stop()
        starts: dict[tuple[str, int], int | None] = {
            (topic, p): None for topic, (partitions, _) in affected.items() for p in partitions}
        for window in (*LOOKBACK, None):
            missing = {(topic, p): (EPOCH if window is None else affected[topic][1] - window,
                                    affected[topic][1])
                       for (topic, p), start in starts.items() if start is None}
            if not missing:
                break
            with conn.begin():
                found = store.recorded_offsets(conn, self.schema, missing)
            starts.update({tp: offset + 1 for tp, offset in found.items()})
        return starts

    def _record(self, conn: Connection, tail: Tail, shards: frozenset[int]) -> int:
        """Record the found ids still pending in ``shards`` as delivered where they are."""
        if not tail.found:
            return 0
        with conn.begin():
            mine = store.pending_in_shards(conn, self.schema, self.settings.worker_id,
                                           tail.ids(), sorted(shards))
            acks = sorted((fp[0], *tail.found[fp]) for fp in mine if fp in tail.found)
            if len(acks) < len(mine):
                log.info("relay %s: %d records in the partition tails carry the id of a pending "
                         "message but not its topic, key and payload (another outbox "
                         "publishing to the same topic); those messages are sent",
                         self.settings.worker_id, len(mine) - len(acks))
            return len(store.mark_delivered(conn, self.schema, self.actor, acks))
