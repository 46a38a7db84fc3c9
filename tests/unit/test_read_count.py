"""How many parallel JDBC reads a reconciliation window is cut into."""

from __future__ import annotations

import pytest

from outbox.spark.sources import read_count


@pytest.mark.parametrize(("rows", "cores", "at_most", "reads"), [
    (5_000_000, 2, 8, 2),  # one read per core of local[2]
    (5_000_000, 16, 8, 8),  # a cluster: the setting caps it
    (5_000_000, 16, 1024, 16),
    (20_000_000, 2, 8, 8),  # more than the cores, to keep each read at 2.5M rows
    (50_000_000, 2, 8, 8),  # ... but never more than the setting
    (120_000, 16, 8, 3),  # none under 50,000 rows
    (10_000, 4, 8, 1),
    (0, 2, 8, 1),
])
def test_a_window_is_read_once_per_core_within_the_setting_and_the_row_limits(
    rows: int, cores: int, at_most: int, reads: int
) -> None:
    assert read_count(rows, cores, at_most) == reads
