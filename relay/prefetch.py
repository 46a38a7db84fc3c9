"""The relay's next batch, fetched while it sends the one before.

Draining a backlog with kafka-python, the relay's main thread spent about two thirds of its
time in the producer's ``send()`` and a quarter waiting for PostgreSQL to answer its next
fetch (py-spy, BENCHMARKS.md "Prefetch, session 49"). So while it sends a full batch, the
next one is fetched on the fetching connection in a thread of its own, the ids in flight
including the batch being sent. It is taken only for the same shards and held topics it was
fetched for, and never after a refused send (Relay._send): then it is dropped and the loop
fetches again, as before. Only with a transport whose ``fetch_ahead`` says so: librdkafka's
``send`` is cheap, and the thread only cost it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor

from outbox import store

Batch = list[store.Deliverable]
#: What a batch was fetched for: the shards, and the topics held then.
Key = tuple[frozenset[int], frozenset[str]]


class Prefetch:
    """At most one fetch ahead, on one thread; used by the relay's main loop alone."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, name)
        self._ahead: tuple[Future[Batch], Key] | None = None

    def start(self, fetch: Callable[[], Batch], shards: Collection[int],
              held: Collection[str]) -> None:
        """Fetch ahead with ``fetch``, for ``shards`` with the topics ``held``."""
        self.drop()
        self._ahead = self._pool.submit(fetch), (frozenset(shards), frozenset(held))

    def take(self, shards: Collection[int], held: Collection[str]) -> Batch | None:
        """The batch fetched ahead for ``shards`` and ``held``; None if there is none, it was
        fetched for other shards or held topics, or it is empty (rows may have come since).
        A failed fetch raises here, as it would have in the loop."""
        if self._ahead is None:  # nearly every fetch but a backlog's: nothing built
            return None
        future, fetched_for = self._ahead
        self._ahead = None
        batch = future.result()
        return batch if batch and fetched_for == (frozenset(shards), frozenset(held)) else None

    def drop(self) -> None:
        """Wait for the fetch ahead, if any, and forget its batch (a failure raises)."""
        if self._ahead is not None:
            future, self._ahead = self._ahead[0], None
            future.result()

    def close(self) -> None:
        """At the loop's end, before its connection closes: wait for the fetch ahead (its
        failure is the pass's to report, if any) and stop the thread."""
        with contextlib.suppress(Exception):
            self.drop()
        self._pool.shutdown()
