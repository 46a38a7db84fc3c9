"""Progress lines while a run's Spark jobs work: a run reading a large window, or waiting on a
broker that died (silent until the reader's stall timeout, 120 s), said nothing for minutes.

A daemon thread on the driver logs one line every ``reconcile_progress_seconds`` while a
phase of the run is under way: its Spark jobs' tasks, from Spark's status tracker, or that
the driver works on its own (its queries to PostgreSQL or Kafka, which were silent); none
for a run quicker than that.
"""

from __future__ import annotations

import logging
import threading
import time

from pyspark import SparkContext, SparkStageInfo


class Progress:
    """The progress thread of one run, from ``with`` to its end, however the run ends.
    ``phase`` is the phase under way (reconcile._phase sets it), named in the lines."""

    def __init__(self, context: SparkContext, logger: logging.Logger, interval: float) -> None:
        self.phase: str | None = None
        self._context = context
        self._log = logger
        self._interval = interval
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="reconcile-progress",
                                        daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                stages = active_stages(self._context)
            except Exception:  # the run goes on without its progress lines
                self._log.debug("cannot read the Spark jobs' progress", exc_info=True)
                continue
            if (stages or self.phase) and not self._stop.is_set():
                self._log.info("%s", line(self.phase, time.monotonic() - self._started, stages))


def active_stages(context: SparkContext) -> list[SparkStageInfo]:
    """The stages running now (one finished since it was listed has no info: left out)."""
    tracker = context.statusTracker()
    infos = (tracker.getStageInfo(stage) for stage in tracker.getActiveStageIds())
    return [info for info in infos if info is not None]


def line(phase: str | None, seconds: float, stages: list[SparkStageInfo]) -> str:
    """``still running after 95s (read topics): 3 of 8 tasks done, 2 running, 1 failed``;
    failed tasks (an executor that lost Kafka or the database) only when there are some.
    Without stages: ``still running after 95s (match): the driver's own work, no Spark job``."""
    said = f"still running after {seconds:.0f}s{f' ({phase})' if phase else ''}: "
    if not stages:
        return said + "the driver's own work, no Spark job"
    done = sum(s.numCompletedTasks for s in stages)
    failed = sum(s.numFailedTasks for s in stages)
    return (said + f"{done} of {sum(s.numTasks for s in stages)} tasks done, "
            f"{sum(s.numActiveTasks for s in stages)} running"
            + (f", {failed} failed" if failed else ""))
