"""What `outbox relay` and `outbox sweeper` set up in their own process."""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Iterator

import pytest

from outbox.relay.daemon import Lifecycle, run_until_signalled


class Recording:
    """A daemon that notes how many objects the garbage collector leaves alone as it runs."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle("recording", logging.getLogger("test"))
        self.frozen = 0

    def run(self) -> None:
        self.frozen = gc.get_freeze_count()

    def stop(self, *, abandon: bool = False) -> None:
        self.lifecycle.stop(abandon=abandon)


@pytest.fixture
def restored() -> Iterator[None]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        gc.unfreeze()
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_daemon_runs_with_its_start_up_objects_frozen_out_of_the_collector(
    restored: None,
) -> None:
    """Full collections walking them again and again cost the relay a fifth of its
    throughput."""
    assert gc.get_freeze_count() == 0
    daemon = Recording()
    run_until_signalled(daemon)
    assert daemon.frozen > 1000
