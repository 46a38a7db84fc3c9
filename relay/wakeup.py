"""Waking the relay soon after a commit: LISTEN on the schema's channel, poll as a fallback."""

from __future__ import annotations

import threading

import psycopg
from psycopg import sql

from outbox import store
from outbox.settings import sqlalchemy_url


class Wakeup:
    """A dedicated autocommit connection LISTENing for committed prepare rows."""

    def __init__(self, database_url: str, schema: str) -> None:
        dsn = sqlalchemy_url(database_url).replace("postgresql+psycopg://", "postgresql://", 1)
        self._conn = psycopg.connect(dsn, autocommit=True)
        channel = sql.Identifier(store.notify_channel(schema))
        self._conn.execute(sql.SQL("LISTEN {}").format(channel))

    def wait(self, timeout: float, stop: threading.Event, slice_seconds: float = 0.1
             ) -> set[str]:
        """Block until notified, ``timeout`` or ``stop``; returns the payloads received
        (``""`` for a commit, ``"rebalance"`` when a relay joined or left)."""
        remaining = timeout
        while remaining > 0 and not stop.is_set():
            step = min(slice_seconds, remaining)
            payloads = {n.payload for n in self._conn.notifies(timeout=step, stop_after=1)}
            if payloads:
                return payloads | self.drain()
            remaining -= step
        return set()

    def drain(self) -> set[str]:
        return {n.payload for n in self._conn.notifies(timeout=0)}

    def close(self) -> None:
        self._conn.close()
