"""The README's first command, `make demo`, runs examples/orders_demo.py: the whole flow on
throwaway embedded services. It must keep working whatever the storage looks like."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_demo_runs_the_whole_flow_and_reconciles_clean() -> None:
    result = subprocess.run([sys.executable, "examples/orders_demo.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "outbox reconciliation run 1: CLEAN" in result.stdout, result.stdout[-3000:]
    assert "waiting for the relay to deliver the committed orders" in result.stdout
