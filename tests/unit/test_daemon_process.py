"""What `outbox relay` and `outbox sweeper` set up in their own process."""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Iterator

import pytest

from outbox.relay.daemon import GC_THRESHOLDS, Lifecycle, run_until_signalled


class Recording:
    """A daemon that notes the collector's thresholds it runs under."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle("recording", logging.getLogger("test"))
        self.thresholds: tuple[int, ...] = ()

    def run(self) -> None:
        self.thresholds = gc.get_threshold()

    def stop(self, *, abandon: bool = False) -> None:
        self.lifecycle.stop(abandon=abandon)


@pytest.fixture
def restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_daemon_runs_with_the_garbage_collector_set_to_collect_less_often(
    restored: None,
) -> None:
    """Python's default (700 allocations) cost the relay a fifth of its throughput."""
    daemon = Recording()
    run_until_signalled(daemon)
    assert daemon.thresholds == GC_THRESHOLDS
