"""Server-rendered SVG charts: coordinates computed here, drawn by the template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 600.0, 120.0


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float


def _y(value: float, y_max: float) -> float:
    return round(HEIGHT - (HEIGHT - 8) * value / y_max, 1) if y_max > 0 else HEIGHT


def line(points: Sequence[tuple[float, float | None]], x_min: float, x_max: float,
         y_max: float) -> list[tuple[float, float]]:
    """``(x, y)`` points in the chart's pixels (None values are skipped)."""
    span = (x_max - x_min) or 1.0
    return [(round(WIDTH * (x - x_min) / span, 1), _y(y, y_max))
            for x, y in points if y is not None]


def bars(points: Sequence[tuple[float, float]], x_min: float, x_max: float, y_max: float,
         slot: float) -> list[Bar]:
    """One bar per ``(x, value)``, ``slot`` wide on the x axis."""
    span = (x_max - x_min) or 1.0
    width = max(1.0, round(WIDTH * slot / span - 1, 1))
    return [Bar(round(WIDTH * (x - x_min) / span, 1), _y(y, y_max), width,
                round(HEIGHT - _y(y, y_max), 1)) for x, y in points]
