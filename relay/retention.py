"""Retention: prune delivered and rolled-back rows, and op records, past the window.

Deletes run in bounded batches, each its own short transaction, on a thread and a
connection of their own, so the relay's loop never waits for them.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError

from outbox import store
from outbox.exceptions import first_line
from outbox.settings import RelaySettings

log = logging.getLogger("outbox.retention")


def prune(settings: RelaySettings, stop: threading.Event | None = None) -> tuple[int, int]:
    """Delete everything past the retention window, batch by batch; returns the totals."""
    engine = create_engine(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    totals = [0, 0]
    try:
        with engine.connect() as conn:
            while stop is None or not stop.is_set():
                with conn.begin():
                    batch = store.prune(conn, settings.schema_name,
                                        settings.retention_hours * 3600,
                                        settings.prune_batch_size)
                totals[0] += batch[0]
                totals[1] += batch[1]
                if batch[0] < settings.prune_batch_size:
                    break
    finally:
        engine.dispose()
    if any(totals):
        log.info("pruned %d messages and %d op records older than %.0f h", *totals,
                 settings.retention_hours)
    return totals[0], totals[1]


class Pruner(threading.Thread):
    """Runs :func:`prune` every ``prune_interval`` seconds inside the relay."""

    def __init__(self, settings: RelaySettings) -> None:
        super().__init__(name="pruner", daemon=True)
        self._settings = settings
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.wait(self._settings.prune_interval):
            try:
                prune(self._settings, self._halt)
            except DBAPIError as exc:
                log.warning("retention pass failed (%s); trying again in %.0fs",
                            first_line(exc), self._settings.prune_interval)
