"""Server-rendered SVG charts: coordinates computed here, drawn by the template."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WIDTH, HEIGHT = 600.0, 120.0
#: Backlog samples further apart than this (no page was open) are not joined by a line.
TREND_GAP = 120.0


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float


def _y(value: float, y_max: float) -> float:
    return round(HEIGHT - (HEIGHT - 8) * value / y_max, 1) if y_max > 0 else HEIGHT


def lines(points: Sequence[tuple[float, float | None]], x_min: float, x_max: float,
          y_max: float, gap: float) -> list[list[tuple[float, float]]]:
    """``(x, y)`` points in the chart's pixels, as runs broken where the data has a hole
    (x further than ``gap`` from the point before, or y None), so no line spans it."""
    span = (x_max - x_min) or 1.0
    runs: list[list[tuple[float, float]]] = []
    last: float | None = None
    for x, y in points:
        if y is None:
            last = None
            continue
        if last is None or x - last > gap:
            runs.append([])
        runs[-1].append((round(WIDTH * (x - x_min) / span, 1), _y(y, y_max)))
        last = x
    return runs


def bars(points: Sequence[tuple[float, float]], x_min: float, x_max: float, y_max: float,
         slot: float) -> list[Bar]:
    """One bar per ``(x, value)``, ``slot`` wide on the x axis."""
    span = (x_max - x_min) or 1.0
    width = max(1.0, round(WIDTH * slot / span - 1, 1))
    return [Bar(round(WIDTH * (x - x_min) / span, 1), _y(y, y_max), width,
                round(HEIGHT - _y(y, y_max), 1)) for x, y in points]


def charts(minutes: list[dict[str, Any]], trend: list[tuple[float, int]],
           window_seconds: float) -> dict[str, Any]:
    """What the page draws: delivered/s bars and latency lines per minute of the window
    (``minutes`` from overview), and the backlog trend, in the chart's pixels."""
    now = time.time()
    start = now - window_seconds
    points = [(row["minute"].timestamp(), row) for row in minutes]
    rate_max = max((row["per_second"] for _, row in points), default=0.0)
    latency_max = max((row["p99"] or 0.0 for _, row in points), default=0.0)
    trend_max = max((total for _, total in trend), default=0)
    return {
        "rate": bars([(x, row["per_second"]) for x, row in points], start, now, rate_max, 60),
        "rate_max": rate_max,
        "latency": {p: lines([(x, row[p]) for x, row in points], start, now, latency_max, 60)
                    for p in ("p50", "p95", "p99")},
        "latency_max": latency_max,
        "trend": lines([(t, float(total)) for t, total in trend], start, now, float(trend_max),
                       TREND_GAP),
        "trend_max": trend_max,
        "width": WIDTH, "height": HEIGHT,
    }
