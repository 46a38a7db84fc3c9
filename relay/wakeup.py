"""Waking the relay soon after a commit: LISTEN on the schema's channel, poll as a fallback.

PostgreSQL commits transactions that NOTIFY one at a time, which halves what 16 writers can
commit (BENCHMARKS.md). So publishers notify only while a relay sleeps on their shard: a
relay with nothing to deliver *falls asleep* (takes its shards' wake locks), fetches once
more, then waits; once it has been delivering without a pause for ``BUSY_BEFORE_RISING``, it
*rises* (lets go) and publishers stay quiet until it runs out of work again.
"""

from __future__ import annotations

import threading

from psycopg import sql

from outbox import store

#: Wake-ups in a row that found nothing to deliver before the relay starts pausing after each
#: notification (anyone may NOTIFY the channel: a flood must not spin the relay), the first
#: pause, and the longest (a real commit during a flood waits at most this long).
FREE_WAKES = 3
FIRST_PAUSE = 0.001
MAX_PAUSE = 0.1
#: Seconds of delivering without an empty fetch after which a relay lets go of its wake
#: locks. Below this load publishers keep notifying (cheap when commits are few) and the
#: relay saves the round trips of rising and falling asleep between small batches.
BUSY_BEFORE_RISING = 0.05
#: How long falling asleep waits for the publishers that hold a shard's wake lock (they did
#: not notify); past it the relay fetches again and retries, polling at this pace while a
#: publishing transaction stays open.
FALL_ASLEEP_WAIT_MS = 10


class Wakeup:
    """A dedicated autocommit connection LISTENing for committed prepare rows.

    Notifications are hints, coalesced: however many arrive, one wake-up reads them all. When
    wake-ups keep finding nothing (:meth:`found_work`), each next one first pauses, doubling up
    to ``MAX_PAUSE``, so a flood costs a bounded number of fetches a second.
    """

    def __init__(self, url: str, schema: str) -> None:
        """``url``: the settings' ``sqlalchemy_url`` (its timeouts included)."""
        self._idle_wakes = 0
        self._schema = schema
        #: The shards whose wake locks this relay holds (empty: awake).
        self.asleep_on: frozenset[int] = frozenset()
        #: Whether the last :meth:`wait` found nothing that had arrived already.
        self.waited = False
        self._conn = store.connect(url, autocommit=True)
        store.set_session(self._conn, {**store.SET_ASIDE_SETTINGS,
                                       "lock_timeout": f"{FALL_ASLEEP_WAIT_MS}ms"})
        channel = sql.Identifier(store.notify_channel(schema))
        self._conn.execute(sql.SQL("LISTEN {}").format(channel))

    def fall_asleep(self, shards: frozenset[int]) -> set[str] | None:
        """Make publishers of ``shards`` notify from now on. Returns the notifications that
        arrived before (the fetch that must follow covers their rows), or None when a
        publisher that did not notify is still open (fetch again, then retry)."""
        if not store.fall_asleep(self._conn, self._schema, shards):
            return None
        self.asleep_on = shards
        return self.drain()

    def rise(self) -> None:
        """Publishers stop notifying: the relay is busy and fetches again by itself."""
        if self.asleep_on:
            store.rise(self._conn, self._schema)
            self.asleep_on = frozenset()

    def wait(self, timeout: float, stop: threading.Event, changed: threading.Event,
             slice_seconds: float = 0.1) -> set[str]:
        """Block until notified, ``timeout``, ``stop`` or ``changed`` (the relay took shards
        or has some to hand back); returns the payloads received (``""`` for a commit,
        ``"rebalance"`` when a relay joined or left). Sets ``waited``: whether nothing had
        arrived yet (the relay paused)."""
        payloads = self.drain()
        self.waited = not payloads
        remaining = timeout
        while not payloads and remaining > 0 and not stop.is_set() and not changed.is_set():
            step = min(slice_seconds, remaining)
            payloads = {n.payload for n in self._conn.notifies(timeout=step, stop_after=1)}
            remaining -= step
        if payloads:
            if pause := self._pause():
                stop.wait(pause)
            payloads |= self.drain()
        return payloads

    def found_work(self, found: bool) -> None:
        """Whether the fetch after the last notification found anything to deliver."""
        self._idle_wakes = 0 if found else self._idle_wakes + 1

    def _pause(self) -> float:
        extra = self._idle_wakes - FREE_WAKES
        # the exponent capped too: the count of idle wake-ups is not (2.0 ** 1024 overflows)
        return 0.0 if extra < 0 else min(MAX_PAUSE, FIRST_PAUSE * 2.0 ** min(extra, 16))

    def drain(self) -> set[str]:
        return {n.payload for n in self._conn.notifies(timeout=0)}

    def close(self) -> None:
        self._conn.close()
