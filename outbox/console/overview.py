"""What the console's page shows, read from the database through ``outbox.store`` (the same
queries as ``outbox status``) in one short read-only transaction."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from outbox import store
from outbox.settings import ConsoleSettings

#: Deliveries and latency are shown over this window (and per minute of it).
WINDOW_SECONDS = 3600.0
#: The window's totals and percentiles are read again at most this often; in between a page
#: reads only the minute before and the current one (minutes that ended are kept), so an open
#: page does not sort an hour of deliveries every few seconds.
WHOLE_WINDOW_EVERY = 60.0
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
    held: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    trend: list[tuple[float, int]] = field(default_factory=list)


def read(conn: Connection, settings: ConsoleSettings, held: HeldFilter, overdue_seconds: float,
         deliveries: Deliveries) -> Overview:
    """Everything the page shows, in one read-only transaction (one consistent snapshot;
    the hour's delivery totals may be up to WHOLE_WINDOW_EVERY older)."""
    schema = settings.schema_name
    with conn.begin():
        store.begin_snapshot(conn, schema)
        topics = store.status_by_topic(conn, schema)
        whole, minutes = deliveries.read(conn, schema)
        key = None if held.key is None else held.key.encode()
        return Overview(
            topics=topics,
            totals={state: sum(int(t[state]) for t in topics) for state in STATES},
            check_backs=store.check_backlog(conn, schema, overdue_seconds),
            relays=store.relays(conn, schema, settings.relay_lease_seconds),
            leases=store.lease_owners(conn, schema),
            window=_window(whole),
            minutes=[_minute(row) for row in minutes],
            held=store.held_messages(conn, schema, topic=held.topic, key=key,
                                     limit=HELD_LIMIT, preview_bytes=PREVIEW_BYTES),
            runs=store.reconcile_runs(conn, schema, RUNS_LIMIT),
        )


def _latency(row: dict[str, Any] | None) -> dict[str, float | None]:
    values = (row or {}).get("latency") or [None, None, None]
    return dict(zip(("p50", "p95", "p99"), values, strict=True))


def _window(whole: dict[str, Any] | None) -> dict[str, Any]:
    delivered = int(whole["delivered"]) if whole else 0
    return {"delivered": delivered, "per_second": delivered / WINDOW_SECONDS,
            **_latency(whole)}


def _minute(row: dict[str, Any]) -> dict[str, Any]:
    return {"minute": row["minute"], "delivered": int(row["delivered"]),
            "per_second": int(row["delivered"]) / 60, **_latency(row)}


class Deliveries:
    """The deliveries of the window per minute and in all, read through ``store`` at a
    bounded cost (see WHOLE_WINDOW_EVERY); one per console, shared by its requests."""

    def __init__(self, whole_every: float = WHOLE_WINDOW_EVERY) -> None:
        self._whole_every = whole_every
        self._minutes: dict[datetime, dict[str, Any]] = {}
        self._whole: dict[str, Any] | None = None
        self._whole_at = float("-inf")
        self._lock = threading.Lock()

    def read(self, conn: Connection, schema: str
             ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The window's totals, and its minutes oldest first."""
        with self._lock:
            whole_due = time.monotonic() - self._whole_at >= self._whole_every
            rows = store.delivery_history(conn, schema, WINDOW_SECONDS if whole_due else 60.0)
            if whole_due:
                self._minutes.clear()
                self._whole, self._whole_at = rows[0], time.monotonic()
            self._minutes.update((row["minute"], row) for row in rows[1:])
            for minute in sorted(self._minutes)[:-61]:
                del self._minutes[minute]
            return self._whole, [self._minutes[m] for m in sorted(self._minutes)]


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
