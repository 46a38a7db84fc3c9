"""The progress lines of a reconciliation run (spark/progress.py); a real run's are proven in
test_reconcile_runs.py."""

from __future__ import annotations

import logging
import threading
import time
from typing import NoReturn, cast

import pytest
from pyspark import SparkContext, SparkStageInfo

from outbox.spark.progress import Progress, line


def stage(tasks: int, done: int, running: int, failed: int = 0) -> SparkStageInfo:
    return SparkStageInfo(7, 0, "count at reconcile.py:230", tasks, running, done, failed)


def test_a_line_sums_the_active_stages_and_names_failed_tasks_only_when_there_are_some() -> None:
    assert line("read topics", 95.4, [stage(8, 3, 2, failed=1), stage(4, 0, 0)]) == (
        "still running after 95s (read topics): 3 of 12 tasks done, 2 running, 1 failed")
    assert line("match", 31, [stage(16, 3, 3)]) == (
        "still running after 31s (match): 3 of 16 tasks done, 3 running")


class Idle:
    """A SparkContext running no job: the driver works on its own."""

    def statusTracker(self) -> Idle:
        return self

    def getActiveStageIds(self) -> list[int]:
        return []


def test_a_phase_of_the_drivers_own_work_is_said_too_and_nothing_before_the_first_phase(
    caplog: pytest.LogCaptureFixture
) -> None:
    """The driver's queries (JDBC look-ups, Kafka's offsets), a large part of a run and all
    of one stuck on a broker's metadata, went without a line."""
    with caplog.at_level("INFO", logger="outbox.reconcile"), Progress(
            cast(SparkContext, Idle()), logging.getLogger("outbox.reconcile"), 0.01
            ) as progress:
        time.sleep(0.1)
        assert "still running" not in caplog.text  # no phase under way yet
        progress.phase = "match"
        deadline = time.monotonic() + 10
        while "still running" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    said = {r.getMessage().split(": ", 1)[1] for r in caplog.records}
    assert said == {"the driver's own work, no Spark job"}, caplog.text
    assert all(r.getMessage().endswith(f"(match): {next(iter(said))}") for r in caplog.records)


class LostGateway:
    """A SparkContext whose status tracker fails (its JVM gone), counting the calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.called_twice = threading.Event()

    def statusTracker(self) -> NoReturn:
        self.calls += 1
        if self.calls == 2:
            self.called_twice.set()
        raise ConnectionError("the Java gateway went away")


def test_a_failing_status_tracker_is_logged_at_debug_and_the_thread_ends_with_the_run(
    caplog: pytest.LogCaptureFixture
) -> None:
    context = LostGateway()
    with caplog.at_level("DEBUG", logger="outbox.reconcile"), pytest.raises(
            ValueError, match="the run failed"), Progress(
            cast(SparkContext, context), logging.getLogger("outbox.reconcile"), 0.01):
        assert context.called_twice.wait(30), "the thread stopped at the first failure"
        raise ValueError("the run failed")

    assert {r.levelname for r in caplog.records} == {"DEBUG"}
    assert "cannot read the Spark jobs' progress" in caplog.text
    assert "reconcile-progress" not in {t.name for t in threading.enumerate()}
