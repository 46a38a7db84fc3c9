"""Running ``outbox`` commands as real processes, to kill them for real."""

from __future__ import annotations

import os
import subprocess
import sys

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


def start_outbox(settings: Settings, *args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbox", *args],
        env=outbox_env(settings, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_outbox(settings: Settings | None, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env if env is not None else outbox_env(settings) if settings else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
