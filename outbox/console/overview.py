"""What the console's page shows, read from the database through ``outbox.store`` (the same
queries as ``outbox status``) in one short read-only transaction."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from outbox import store
from outbox.settings import Settings

#: Deliveries and latency are shown over this window (and per minute of it).
WINDOW_SECONDS = 3600.0
#: Most bytes of a payload the page shows; the rest is only counted.
PREVIEW_BYTES = 200
HELD_LIMIT = 200
RUNS_LIMIT = 10
STATES = ("pending", "unresolved", "delayed", "parked", "discarded")


@dataclass(frozen=True)
class HeldFilter:
    """Which PARKED and DISCARDED messages to list (None: any)."""

    topic: str | None = None
    key: str | None = None


@dataclass
class Overview:
    topics: list[dict[str, Any]]
    totals: dict[str, int]
    check_backs: list[dict[str, Any]]
    relays: list[dict[str, Any]]
    leases: list[dict[str, Any]]
    window: dict[str, Any]
    minutes: list[dict[str, Any]]
    held: list[store.Held]
    runs: list[dict[str, Any]]
    trend: list[tuple[float, int]] = field(default_factory=list)


def read(conn: Connection, settings: Settings, held: HeldFilter, overdue_seconds: float
         ) -> Overview:
    """Everything the page shows, in one read-only transaction (one consistent snapshot)."""
    schema = settings.schema_name
    with conn.begin():
        store.begin_snapshot(conn, schema)
        topics = store.status_by_topic(conn, schema)
        history = store.delivery_history(conn, schema, WINDOW_SECONDS)
        key = None if held.key is None else held.key.encode()
        return Overview(
            topics=topics,
            totals={state: sum(int(t[state]) for t in topics) for state in STATES},
            check_backs=store.check_backlog(conn, schema, overdue_seconds),
            relays=store.relays(conn, schema, settings.relay_lease_seconds),
            leases=store.lease_owners(conn, schema),
            window=_window(history),
            minutes=[_minute(row) for row in history if row["minute"] is not None],
            held=store.held_messages(conn, schema, topic=held.topic, key=key,
                                     limit=HELD_LIMIT, preview_bytes=PREVIEW_BYTES),
            runs=store.reconcile_runs(conn, schema, RUNS_LIMIT),
        )


def _latency(row: dict[str, Any] | None) -> dict[str, float | None]:
    values = (row or {}).get("latency") or [None, None, None]
    return dict(zip(("p50", "p95", "p99"), values, strict=True))


def _window(history: list[dict[str, Any]]) -> dict[str, Any]:
    whole = next((row for row in history if row["minute"] is None), None)
    delivered = int(whole["delivered"]) if whole else 0
    return {"delivered": delivered, "per_second": delivered / WINDOW_SECONDS,
            **_latency(whole)}


def _minute(row: dict[str, Any]) -> dict[str, Any]:
    return {"minute": row["minute"], "delivered": int(row["delivered"]),
            "per_second": int(row["delivered"]) / 60, **_latency(row)}


class Trend:
    """The total backlog as sampled by page loads over the last hour (kept in memory: the
    database keeps no history of its backlog), at most one sample per ``spacing`` seconds."""

    def __init__(self, spacing: float, span: float = WINDOW_SECONDS) -> None:
        self._spacing, self._span = spacing, span
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, total: int) -> list[tuple[float, int]]:
        """Record ``total`` now (unless a sample is too recent); returns the samples."""
        now = time.time()
        with self._lock:
            if not self._samples or now - self._samples[-1][0] >= self._spacing:
                self._samples.append((now, total))
            while self._samples and now - self._samples[0][0] > self._span:
                self._samples.popleft()
            return list(self._samples)
