"""Shard leases: which relay delivers which keys, so several relays keep per-key order.

Keys hash into ``SHARDS`` virtual shards. Each relay heartbeats, renews its leases every
third of a lease, takes a fair share of free or expired shards and sheds any surplus
between batches. A relay killed with -9 loses its shards when their leases expire.
"""

from __future__ import annotations

import math
import time

from sqlalchemy import Connection

from outbox import store
from outbox.schema import SHARDS


class Leases:
    def __init__(self, schema: str, worker_id: str, lease_seconds: float) -> None:
        self.schema = schema
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.owned: frozenset[int] = frozenset()
        self._valid_until = 0.0
        self._next_tick = 0.0

    @property
    def valid(self) -> bool:
        """True while our leases certainly have not expired (with a safety margin)."""
        return time.monotonic() < self._valid_until

    def due(self) -> bool:
        return time.monotonic() >= self._next_tick

    def maintain(self, conn: Connection) -> tuple[frozenset[int], frozenset[int]]:
        """Renew, claim and shed leases in one transaction; returns (gained, lost) shards."""
        started = time.monotonic()
        with conn.begin():
            live = store.heartbeat(conn, self.schema, self.worker_id, self.lease_seconds)
            mine = store.renew_leases(conn, self.schema, self.worker_id, self.lease_seconds)
            share = math.ceil(SHARDS / max(live, 1))
            if len(mine) < share:
                mine |= store.claim_leases(
                    conn, self.schema, self.worker_id, self.lease_seconds, share - len(mine)
                )
            elif len(mine) > share:
                surplus = sorted(mine)[share:]
                store.release_leases(conn, self.schema, self.worker_id, surplus)
                mine -= set(surplus)
        owned = frozenset(mine)
        gained, lost = owned - self.owned, self.owned - owned
        self.owned = owned
        self._valid_until = started + self.lease_seconds * 0.8
        self._next_tick = started + self.lease_seconds / 3
        return gained, lost

    def leave(self, conn: Connection) -> None:
        with conn.begin():
            store.leave(conn, self.schema, self.worker_id)
        self.owned = frozenset()
        self._valid_until = 0.0
