"""Running ``outbox`` commands as real processes, to kill them for real."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

from outbox.settings import Settings


def outbox_env(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OUTBOX_DATABASE_URL": settings.database_url,
        "OUTBOX_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "OUTBOX_KAFKA_CLIENT": settings.kafka_client,
        "OUTBOX_SCHEMA": settings.schema_name,
        "OUTBOX_RELAY_LEASE_SECONDS": str(settings.relay_lease_seconds),
        "OUTBOX_RELAY_POLL_INTERVAL": str(settings.relay_poll_interval),
        "OUTBOX_PRUNE_BATCH_SIZE": str(settings.prune_batch_size),
        "OUTBOX_PARTITION_SIZE": str(settings.partition_size),
        "OUTBOX_KAFKA_MAX_REQUEST_SIZE": str(settings.kafka_max_request_size),
        **extra,
    }


class OutboxProcess(subprocess.Popen[str]):
    """An ``outbox`` command whose output (stdout and stderr) goes to a file, not a pipe: a
    pipe nobody reads fills up and blocks a chatty process in the middle of a test.
    ``communicate`` waits for it and returns what it printed, as with a pipe."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        descriptor, self.log = tempfile.mkstemp(prefix="outbox-", suffix=".log")
        weakref.finalize(self, os.unlink, self.log)
        with os.fdopen(descriptor, "w") as log:
            super().__init__(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, None]:
        assert input is None, "an outbox command reads no input"
        self.wait(timeout)
        return Path(self.log).read_text(), None


def start_outbox(settings: Settings, *args: str, **extra: str) -> OutboxProcess:
    return OutboxProcess([sys.executable, "-m", "outbox", *args], outbox_env(settings, **extra))


def run_outbox(settings: Settings | None, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env if env is not None else outbox_env(settings) if settings else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Spark's JVM, for a reconciliation)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
