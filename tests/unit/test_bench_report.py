"""make bench's table: verdicts, rendering, and the marker block it rewrites in BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


report = load_report()


def test_verdicts_follow_the_target() -> None:
    assert report.Figure("r", 90, "msg/s", 100, "raw", (">=", 0.9)).met is True
    assert report.Figure("r", 89, "msg/s", 100, "raw", (">=", 0.9)).met is False
    assert report.Figure("w", 400, "B", target=("<=", 400)).met is True
    assert report.Figure("w", 1600, "B", target=("<=", 400)).met is False
    assert report.Figure("raw", 100, "msg/s").met is None


def test_a_target_not_met_is_printed_as_not_met() -> None:
    figures = [report.Figure("raw", 25_000, "msg/s"),
               report.Figure("relay", 17_500, "msg/s", 25_000, "raw", (">=", 0.9))]
    table = report.markdown_table(figures)
    assert "| relay | 17,500 msg/s | 25,000 msg/s (raw) | 0.70x | ≥ 0.9x | **not met** |" in table
    assert "not met" in report.text_table(figures)


def test_only_the_block_between_the_markers_is_replaced() -> None:
    document = (f"# B\n\nintro\n\n## s\n\n{report.BEGIN}\nold table\n{report.END}\n\n"
                "## other\n\nkept\n")
    updated = report.replace_block(document, "new table")
    assert updated == document.replace("old table", "new table")
    assert report.replace_block(updated, "newer") == document.replace("old table", "newer")


def test_without_markers_a_section_goes_before_the_first_heading() -> None:
    updated = report.replace_block("# B\n\nintro\n\n## other\n", "t")
    assert updated.index(report.BEGIN) < updated.index("## other")
    assert updated.startswith("# B\n\nintro\n\n## `make bench`")


def test_round_ratios_pair_each_round_with_its_own_baseline() -> None:
    runs = {"raw": [100.0, 200.0, 50.0], "relay": [90.0, 260.0, 50.0]}
    assert report.round_ratios(runs, [("relay", "raw")]) == (
        "Round by round: relay 0.90x / 1.30x / 1.00x (of raw).")
