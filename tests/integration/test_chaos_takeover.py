"""The long chaos run of issue 12 §3: over 50,000 messages while relays are killed with -9
more than 20 times, the broker's connections are cut twice and PostgreSQL restarts. Each
takeover reads the partitions' tails first (relay/recovery.py), so nothing is sent twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import run_chaos

pytestmark = pytest.mark.slow
KILLS = [1.5, 3, 4.5, 6, 7.5, 14.5, 16, 17.5, 19, 23, 24.5, 26, 27.5, 29, 36.5, 38, 39.5, 41,
         42.5, 44, 45.5, 47]
SCHEDULE = sorted([(second, "kill") for second in KILLS]
                  + [(9, "cut"), (21, "restart-postgres"), (31, "cut")])


def test_no_duplicates_across_kills_cuts_and_a_postgres_restart(tmp_path: Path) -> None:
    verdict = run_chaos(tmp_path, SCHEDULE, seconds=45, sizes="10,20,40,50",
                        at_least=50_000)
    summary = verdict.summary
    print(summary)
    print(verdict.evidence)  # shown if an assertion fails
    assert verdict.committed >= 50_000, summary
    assert sum("kill" in event for event in verdict.events) >= 20, summary
    assert not verdict.missing, f"committed but never delivered: {verdict.missing[:10]}"
    assert not verdict.unknown, f"in Kafka without a committed prepare row: {verdict.unknown[:10]}"
    assert not verdict.leaked, f"rolled-back messages reached Kafka: {verdict.leaked[:10]}"
    assert not verdict.out_of_order, f"per-key order broken for {verdict.out_of_order[:5]}"
    assert verdict.duplicates == 0, summary
