"""Topics Kafka has no metadata for are held on their own (issue 12 §1).

A producer sending to a topic the cluster does not know (a typo, or a topic not created yet
where auto-creation is off, the production norm) blocks or retries until it gives up, and the
relay would take that for a broker outage and stall every topic. So before a batch goes out,
each topic the relay has not seen yet is looked up once (:meth:`Transport.available`; no
answer at all is a broker outage, which ends the pass as any other). A topic the broker says
it does not know is *held*: its rows stay pending, the fetch skips them (so its keys
keep their order and nothing later overtakes), it is logged once, the ``outbox_topic_held``
gauge says so and `outbox status` shows it, while every other topic keeps flowing. Kafka is
asked again with back-off; when the topic appears its messages go out, and with
``OUTBOX_TOPIC_HOLD_PARK_AFTER`` they are parked once held that long instead.

A topic whose records Kafka *refuses* (no Write ACL for the relay's principal, a timestamp
bound the relay's clock is outside, a message format too old for headers:
:func:`outbox.relay.transport.refuses_topic`) is held the same way, not its records parked one
by one: the refusal is the operator's to mend, and says nothing of the messages. No metadata
request tells a refusal is over, so after each back-off the topic is *tried*: its rows are
fetched and sent again; refused again, it is held again quietly; once Kafka acknowledges one
of its records, it is released. So is a topic whose records Kafka *keeps retrying* while it
acknowledges other topics' (a partition without a leader or enough in-sync replicas, which
the producer retries until its delivery timeout while every topic waits behind it: relay.py's
``_give_up_stuck_topics``).

A held topic's waiting rows are flagged ``held`` as their reason is noted (revision 0024): a
flagged row is out of the index the fetch walks, so a held backlog costs the other topics'
fetches little (1.8x at a million held rows, 27x before), and it holds back its key's later
rows as a delayed row does. A refused topic tried again has the first of its held rows per
shard unflagged (the first no earlier row of its key holds back: one that is would send
nothing), and a released one all of its rows. Flags outlive the relay that wrote
them (killed, stopped, or its shards moved), so every ``HEAL_SECONDS`` each relay looks for
rows of its shards flagged for topics it does not hold and asks Kafka about those topics:
one it still does not know is held by this relay, its rows left flagged; one it knows now is
released if its rows say Kafka did not know it, and else tried as a refused one is (its first
flagged row per shard sent; the rest once Kafka takes one, held by this relay if Kafka
refuses it): unflagging a million rows, only for the fetch to flag them again, took minutes.

A topic deleted after the relay first asked about it looks like a broker away: its records
are retried. Any topic whose records failed so is asked about again before the next batch
is sent to it, and held if Kafka no longer knows it; a batch that waits for acks asks about
its topics after a few seconds, so a deleted topic ends the pass then, not at the delivery
timeout (relay.py, ``TopicGone``).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection

from outbox import store
from outbox.relay import metrics
from outbox.relay.transport import Transport
from outbox.settings import RelaySettings

log = logging.getLogger("outbox.relay")
#: How long one look-up waits for the broker's metadata.
PROBE_SECONDS = 1.0
#: Back-off between look-ups of a held topic: from the first to the last, doubling.
FIRST_RETRY_SECONDS = 1.0
LAST_RETRY_SECONDS = 30.0
#: A refused topic tried again with no answer from Kafka within this is no longer held.
TRIAL_SECONDS = 60.0
#: How often a relay looks for rows of its shards flagged held for topics it does not hold.
HEAL_SECONDS = 10.0
#: At most this many rows flagged or unflagged a step (relay/holds.py's ``_write``).
FLAG_BATCH = 5_000
#: More topics than this held or released in one step are said in one line (a batch of
#: thousands of new topics said a line for each).
EACH_SAID = 5
#: How the reasons of holds on Kafka's metadata begin, noted on their rows: a relay taking
#: such rows over releases them once Kafka describes the topic (others it tries).
UNKNOWN = "held: Kafka has no metadata for topic "
UNDESCRIBED = "held: Kafka will not describe topic "
#: How a hold's reason, noted on its rows, says when it began (read back by the next owner).
BEGAN_FORMAT = "%Y-%m-%d %H:%M:%S UTC"
_SINCE = re.compile(r" since (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC)$")


@dataclass
class Hold:
    since: float  #: monotonic time the topic was first found missing
    reason: str  #: noted on its waiting rows (``held: ...``)
    retry_in: float = FIRST_RETRY_SECONDS
    retry_at: float = 0.0
    parked: int = 0
    parking: int = 0  #: rows parked so far by the park in progress (in steps)
    park_reason: str = ""  #: its reason, the same on all of them
    refused: bool = False  #: Kafka refuses its records (else: Kafka has no metadata for it)
    denied: bool = False  #: Kafka would not describe it to the relay (no Describe ACL)
    began: str = ""  #: when the hold began, as its reason says (UTC)
    stuck: bool = False  #: refused, in that Kafka retries them while it takes other topics'


class TopicHolds:
    """The relay's held topics; used by its main loop, except :meth:`refused`, :meth:`stuck`,
    :meth:`landed` and :meth:`lost`, which the recorder calls with what Kafka answered."""

    def __init__(self, settings: RelaySettings, transport: Transport) -> None:
        self._schema = settings.schema_name
        self._actor = settings.worker_id
        self._park_after = settings.topic_hold_park_after
        self.transport = transport
        self._known: set[str] = set()
        self._held: dict[str, Hold] = {}
        #: refused topics whose rows are being sent again (see the module's docstring)
        self._tried: dict[str, Hold] = {}
        #: their names, which the recorder reads (replaced, never changed in place)
        self.tried: frozenset[str] = frozenset()
        self._answers_lock = threading.Lock()
        #: from the recorder, in the order of the batches: (what Kafka did, topic, error),
        #: what being "refused", "stuck", "landed" (a record of a tried topic) or "lost"
        self._answers: list[tuple[str, str, str]] = []
        #: held topics' reasons to note on their rows at the end of this step (_write)
        self._marks: dict[str, str] = {}
        #: refused topics tried again, and topics released, in this step (_write)
        self._trials: set[str] = set()
        self._released: set[str] = set()
        #: held topics whose reason changed, and where the notes on their flagged rows stand
        self._renoting: dict[str, store.Cursor] = {}
        self._heal_at = 0.0  #: monotonic time to look for rows no hold of this relay's flagged

    @property
    def topics(self) -> list[str]:
        """The held topics, which the fetch skips."""
        return list(self._held)

    @property
    def next_at(self) -> float:
        """When a held or tried topic is next to be asked about (inf: none is): the main
        loop, waiting for notifications, waits no longer."""
        return min((hold.retry_at for hold in (*self._held.values(), *self._tried.values())),
                   default=math.inf)

    def admit(self, conn: Connection, shards: Collection[int],
              batch: list[store.Deliverable]) -> list[store.Deliverable]:
        """``batch`` without the rows of topics Kafka does not know (they are held now)."""
        new = {row.topic for row in batch} - self._known
        if not new:
            return batch
        found = self.transport.available(new, PROBE_SECONDS)
        self._known |= found
        held: dict[str, list[str]] = {}
        now = time.monotonic()  # one back-off for them all: asked about again together
        for topic in sorted(new - found):
            held.setdefault(self._hold(topic, now), []).append(topic)
        self._write(conn, shards)
        for what, topics in held.items():
            _say(topics, "topic %s: %s; holding its messages, other topics keep flowing; %s",
                 "%d topics (%s), each: %s; holding their messages, other topics keep "
                 "flowing; %s",
                 what, self._bound("held until it appears"))
        return [row for row in batch if row.topic not in self._held]

    def refused(self, topic: str, error: str) -> None:
        """Kafka refused a record of ``topic`` for the topic's sake (recorder thread)."""
        with self._answers_lock:
            self._answers.append(("refused", topic, error))

    def stuck(self, topics: Collection[str], waited: float) -> None:
        """Kafka acknowledged other topics' records while these topics' waited ``waited``
        seconds (a partition without a leader or enough in-sync replicas, which the producer
        retries until its delivery timeout): held as refused ones (any thread)."""
        with self._answers_lock:
            self._answers.extend(("stuck", topic, f"{waited:.0f}s") for topic in topics)

    def landed(self, topics: Collection[str]) -> None:
        """Kafka acknowledged records of these tried topics (recorder thread)."""
        with self._answers_lock:
            self._answers.extend(("landed", topic, "") for topic in topics)

    def lost(self, topics: Collection[str]) -> None:
        """Records of these topics failed as retriable errors, as when a topic is deleted:
        the next batch asks Kafka about them before sending to them (any thread)."""
        with self._answers_lock:
            self._answers.extend(("lost", topic, "") for topic in topics)

    def use(self, transport: Transport) -> None:
        """A new producer, which knows no topic yet."""
        self.transport = transport
        self._known.clear()

    def revisit(self, conn: Connection, shards: Collection[int]) -> None:
        """Hold the topics Kafka refused since, and release the tried ones it took; ask
        Kafka again about the held topics whose back-off has passed (or try a refused one
        again): release those that appeared, note the newcomers of the others, and park them
        once held too long."""
        self._revisit(conn, shards)
        self._write(conn, shards)

    def _revisit(self, conn: Connection, shards: Collection[int]) -> None:
        self._heed_answers()
        now = time.monotonic()
        for topic in [t for t, hold in self._tried.items() if hold.retry_at <= now]:
            self._unheard(topic)
        due = [topic for topic, hold in self._held.items() if hold.retry_at <= now]
        if not due:
            return
        unknown = [topic for topic in due if not self._held[topic].refused]
        found = self.transport.available(unknown, PROBE_SECONDS) if unknown else set()
        appeared = []
        for topic in due:
            hold = self._held[topic]
            if topic in found:
                appeared.append(f"{topic} appeared after {self._release(topic, hold):.1f}s")
                continue
            held_for = time.monotonic() - hold.since
            more = False
            if self._park_after is not None and held_for >= self._park_after:
                more = self._park(conn, shards, topic, hold, held_for)
            elif not hold.refused:
                if hold.denied != (topic in self.transport.denied):
                    log.warning("topic %s: %s; still holding its messages", topic,
                                self._explain(topic, hold))
                    self._renoting[topic] = store.CURSOR_START  # the flagged rows say it
                self._marks[topic] = hold.reason
            if more:
                hold.retry_at = 0.0  # the rest parked in the next steps
            elif hold.refused:
                self._try(topic)  # refused again, it backs off further (_heed_answers)
            else:
                self._back_off(hold)
        _say(appeared, "topic %s: delivering its held messages",
             "%d held topics are known to Kafka now (%s): delivering their held messages")

    def _heed_answers(self) -> None:
        with self._answers_lock:
            answers, self._answers = self._answers, []
        for what, topic, error in answers:
            if what == "landed":
                self._accepted(topic)
            elif what == "lost":
                self._known.discard(topic)
            elif topic not in self._held:
                hold = self._tried.pop(topic, None)
                if hold is None or not hold.reason:  # not held by this relay yet
                    hold = self._hold_refused(topic, error, stuck=what == "stuck",
                                              earlier=hold)
                else:  # tried too soon: back off further, quietly
                    self._back_off(hold)
                self._held[topic] = hold
                self._marks[topic] = hold.reason
        self.tried = frozenset(self._tried)

    def _accepted(self, topic: str) -> None:
        """Kafka took a record of a tried topic (held again if a refusal of a batch sent
        before came in between)."""
        hold = self._tried.pop(topic, None)
        if hold is None and topic in self._held and self._held[topic].refused:
            hold = self._held.pop(topic)
        if hold is not None:
            self._released.add(topic)
            metrics.TOPIC_HELD.labels(topic).set(0)
            if hold.reason:
                log.warning("topic %s: Kafka takes its records again after %.1fs: delivering "
                            "its held messages", topic, time.monotonic() - hold.since)
            else:  # taken over from another relay's flags (_take_over)
                log.info("topic %s: Kafka takes its records: delivering the rest of the "
                         "messages another relay held", topic)

    def _hold_refused(self, topic: str, error: str, stuck: bool,
                      earlier: Hold | None = None) -> Hold:
        """Hold a topic Kafka refuses; ``earlier``: the hold of another relay taken over
        (_take_over), whose start this one keeps."""
        started = earlier.began if earlier is not None else _utc_now()
        if stuck:
            what = (f"Kafka has not acknowledged its records for {error} while it acknowledged "
                    "other topics' (a partition without a leader, or without enough in-sync "
                    "replicas?)")
            reason = (f"held: Kafka retries the records of topic {topic} while it takes other "
                      f"topics' (a partition without a leader, or without enough in-sync "
                      f"replicas?) since {started}")
        else:
            what = f"Kafka refuses its records ({error}), a grant or a setting to mend"
            reason = f"held: Kafka refuses the records of topic {topic} ({error}) since {started}"
        hold = Hold(since=earlier.since if earlier is not None else time.monotonic(),
                    refused=True, stuck=stuck, reason=reason, began=started)
        hold.retry_at = time.monotonic() + hold.retry_in
        log.warning("topic %s: %s; holding its messages, other topics keep flowing; %s", topic,
                    what, self._bound("sent again with back-off until accepted"))
        return hold

    @staticmethod
    def _back_off(hold: Hold) -> None:
        hold.retry_in = min(hold.retry_in * 2, LAST_RETRY_SECONDS)
        hold.retry_at = time.monotonic() + hold.retry_in

    def _try(self, topic: str) -> None:
        """Let the fetch send a refused topic's rows again; with no answer by
        ``TRIAL_SECONDS`` (none of its rows left in this relay's shards), it is let go."""
        hold = self._tried[topic] = self._held.pop(topic)
        hold.retry_at = time.monotonic() + TRIAL_SECONDS
        self.tried = frozenset(self._tried)
        self._trials.add(topic)

    def _unheard(self, topic: str) -> None:
        del self._tried[topic]
        self.tried = frozenset(self._tried)
        self._released.add(topic)
        metrics.TOPIC_HELD.labels(topic).set(0)
        log.info("topic %s: none of its records was sent in %.0fs of trying it again (its "
                 "messages are gone from this relay's shards, or wait behind delayed or "
                 "undecided ones of their keys); no longer held", topic, TRIAL_SECONDS)

    def _hold(self, topic: str, asked: float, since: float | None = None,
              began: str | None = None) -> str:
        """Hold a topic Kafka had no metadata for when ``asked`` (monotonic; topics asked
        about together are asked about again together), since then or since ``since`` and
        ``began``, as another relay's hold taken over says; returns why, to be said."""
        hold = Hold(since=asked if since is None else since, reason="",
                    began=began or _utc_now())
        hold.retry_at = asked + hold.retry_in
        self._held[topic] = hold
        what = self._explain(topic, hold)
        self._marks[topic] = hold.reason
        return what

    def _explain(self, topic: str, hold: Hold) -> str:
        """Why Kafka has no metadata for a held topic (said again when that changes)."""
        hold.denied, started = topic in self.transport.denied, hold.began
        if hold.denied:
            what = ("Kafka will not describe it to the relay (TOPIC_AUTHORIZATION_FAILED: grant "
                    "the relay's principal Describe and Write on it)")
            hold.reason = (f"{UNDESCRIBED}{topic} to the relay "
                           f"(TOPIC_AUTHORIZATION_FAILED: no Describe ACL?) since {started}")
        else:
            what = "Kafka has no metadata for it (does it exist?)"
            hold.reason = (f"{UNKNOWN}{topic} (not created, or auto-creation off) "
                           f"since {started}")
        return what

    def _bound(self, otherwise: str) -> str:
        return (f"parked after {self._park_after:g}s (OUTBOX_TOPIC_HOLD_PARK_AFTER)"
                if self._park_after is not None else otherwise)

    def _write(self, conn: Connection, shards: Collection[int]) -> None:
        """Write, in one transaction, what this step changed of the held topics' rows: the
        rows of topics still held noted and flagged (and noted again if their reason
        changed), the first rows of topics tried again and the rows of topics released back
        in the fetch, after every ``HEAL_SECONDS`` a look for rows of ``shards`` flagged by
        another relay (:meth:`_take_over`). Each at most ``FLAG_BATCH`` rows a step (a million
        rows in one statement held the loop for 20 s): what is left is written in the next
        steps, and so is all of it if the transaction fails. A topic's ``outbox_topic_held``
        gauge says 1 once its rows are noted, so `outbox status` says what the gauge says."""
        if time.monotonic() >= self._heal_at:
            self._take_over(conn, shards)
        if not (self._marks or self._trials or self._released or self._renoting):
            return  # nearly every loop of the relay
        marks = {topic: reason for topic, reason in self._marks.items() if topic in self._held}
        renoting = {topic: at for topic, at in self._renoting.items() if topic in self._held}
        trials = self._trials & self._tried.keys()
        released = self._released - self._held.keys() - self._tried.keys()
        more_marks = more_released = False
        renoted: dict[str, store.Cursor] = {}
        # the queues change only once it commits (only this loop changes them): a rollback
        # leaves them for the next step
        with conn.begin():
            if released:
                more_released = store.release_held(conn, self._schema, released, shards,
                                                   FLAG_BATCH) == FLAG_BATCH
            if trials:
                store.try_held(conn, self._schema, trials, shards)
            if marks:
                more_marks = store.mark_held(conn, self._schema, marks, shards,
                                             FLAG_BATCH) == FLAG_BATCH
            for topic, at in renoting.items():
                noted, at = store.renote_held(conn, self._schema, topic,
                                              self._held[topic].reason, shards, FLAG_BATCH, at)
                if noted == FLAG_BATCH:
                    renoted[topic] = at
        self._marks = marks if more_marks else {}
        self._released = released if more_released else set()
        self._trials, self._renoting = set(), renoted
        for topic in marks:
            metrics.TOPIC_HELD.labels(topic).set(1)

    def _take_over(self, conn: Connection, shards: Collection[int]) -> None:
        """The topics with rows of ``shards`` flagged held by a relay that no longer holds
        them (killed, stopped, or their shards moved), none of them held, tried or released
        by this relay: asked about, those Kafka does not know are held by this relay, their
        rows left flagged; those it knows are released if their rows say Kafka did not know or
        describe them, else tried (a hold without a reason: if Kafka refuses them, they are
        held as refused topics first seen). A hold keeps the start its rows' notes say, for
        `outbox status` and ``topic_hold_park_after``."""
        with conn.begin():
            flagged = store.flagged_topics(
                conn, self._schema, self._held.keys() | self._tried.keys() | self._released,
                shards)
        if flagged:
            found = self.transport.available(list(flagged), PROBE_SECONDS)
            self._known |= found
            now = time.monotonic()
            started = {topic: _started(note, now) for topic, note in flagged.items()}
            known = [topic for topic in flagged if topic in found]
            released = [topic for topic in known
                        if (flagged[topic] or "").startswith((UNKNOWN, UNDESCRIBED))]
            self._released.update(released)
            _say(released, "topic %s: its messages in this relay's shards were flagged held by "
                 "a relay that no longer holds them (stopped, or their shards moved), and Kafka "
                 "knows it now: delivering them", "%d topics (%s) had their messages in this "
                 "relay's shards flagged held by a relay that no longer holds them (stopped, or "
                 "their shards moved), and Kafka knows them now: delivering them")
            tried = [topic for topic in known if topic not in released]
            for topic in tried:
                since, began = started[topic]
                self._tried[topic] = Hold(since=since, reason="", began=began,
                                          retry_at=now + TRIAL_SECONDS)
            self._trials.update(tried)
            self.tried = frozenset(self._tried)
            _say(tried, "topic %s: its messages in this relay's shards were flagged held by "
                 "a relay that no longer holds them (stopped, or their shards moved), and Kafka "
                 "knows it: sending the first of them, the rest once Kafka takes one",
                 "%d topics (%s) had their messages in this relay's shards flagged held by a "
                 "relay that no longer holds them (stopped, or their shards moved), and Kafka "
                 "knows them: sending the first of each, the rest once Kafka takes one")
            held: dict[str, list[str]] = {}
            for topic, note in flagged.items():
                if topic not in found:
                    held.setdefault(self._hold(topic, now, *started[topic]), []).append(topic)
                    if note != self._held[topic].reason:  # another cause now: said on them
                        self._renoting[topic] = store.CURSOR_START
            for what, topics in held.items():
                _say(topics, "topic %s: its messages in this relay's shards were flagged held "
                     "by a relay that no longer holds them, and %s; holding them, other topics "
                     "keep flowing; %s", "%d topics (%s) had their messages in this relay's "
                     "shards flagged held by a relay that no longer holds them, and each: %s; "
                     "holding them, other topics keep flowing; %s",
                     what, self._bound("held until it appears"))
        self._heal_at = time.monotonic() + HEAL_SECONDS

    def _release(self, topic: str, hold: Hold) -> float:
        """Release a held topic that appeared; returns how long it was held."""
        del self._held[topic]
        self._known.add(topic)
        self._released.add(topic)
        metrics.TOPIC_HELD.labels(topic).set(0)
        return time.monotonic() - hold.since

    def _park(self, conn: Connection, shards: Collection[int], topic: str, hold: Hold,
              held_for: float) -> bool:
        """Park at most ``FLAG_BATCH`` of a topic's held rows; returns whether more are left
        (the next step parks them, with the same reason; one ERROR line once all are)."""
        if not hold.park_reason:
            what, mend = (("not acknowledged by Kafka", "mend its partitions") if hold.stuck
                          else ("refused by Kafka", "grant the relay's principal what it lacks")
                          if hold.refused else ("not described by Kafka to the relay",
                                                "grant the relay's principal Describe on it")
                          if hold.denied else ("unknown to Kafka", "create the topic"))
            hold.park_reason = (f"topic {topic} {what} for {held_for:.0f}s "
                                f"(OUTBOX_TOPIC_HOLD_PARK_AFTER={self._park_after:g}): {mend}, "
                                "then `outbox resume --all`")
        with conn.begin():
            parked = store.park_topic(conn, self._schema, self._actor, topic, shards,
                                      hold.park_reason, FLAG_BATCH)
        if parked:
            metrics.PARKED.labels(topic).inc(parked)
        hold.parking += parked
        if parked == FLAG_BATCH:
            return True
        if hold.parking and not hold.parked:
            log.error("%d messages parked: %s", hold.parking, hold.park_reason)
        hold.parked, hold.parking, hold.park_reason = hold.parked + hold.parking, 0, ""
        return False


def _utc_now() -> str:
    """Now, as a hold's reason says when it began."""
    return datetime.now(UTC).strftime(BEGAN_FORMAT)


def _started(note: str | None, now: float) -> tuple[float, str]:
    """When the hold a flagged row's note speaks of began (``... since 2026-12-02 10:00:00
    UTC``): the monotonic time and the note's own words, or ``now`` if it says none (or a
    time to come, another host's clock ahead)."""
    match = _SINCE.search(note or "")
    if match is None:
        return now, _utc_now()
    began = datetime.strptime(match.group(1), BEGAN_FORMAT).replace(tzinfo=UTC)
    ago = (datetime.now(UTC) - began).total_seconds()
    return (now - ago, match.group(1)) if ago >= 0 else (now, _utc_now())


def _say(topics: list[str], each: str, many: str, *args: object) -> None:
    """A WARNING ``each % (topic, *args)`` per topic; for more than ``EACH_SAID``, one
    ``many % (count, the first few, *args)`` instead, each topic's line at DEBUG."""
    if len(topics) > EACH_SAID:
        for topic in topics:
            log.debug(each, topic, *args)
        log.warning(many, len(topics), ", ".join(topics[:EACH_SAID]) + ", ...", *args)
        return
    for topic in topics:
        log.warning(each, topic, *args)
