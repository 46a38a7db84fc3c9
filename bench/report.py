"""The table `make bench` prints and writes into BENCHMARKS.md (pure functions, no services)."""

from __future__ import annotations

import re
from dataclasses import dataclass

BEGIN = "<!-- make bench: begin -->"
END = "<!-- make bench: end -->"
HEADER = ("figure", "value", "baseline", "ratio", "target", "met")


@dataclass(frozen=True)
class Figure:
    """One measured figure; ``target`` is ``(">=", 0.8)`` on the ratio or ``("<=", 400)`` on
    the value, or None (a baseline row, shown without a verdict)."""

    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    target: tuple[str, float] | None = None

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.baseline else None

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        op, bound = self.target
        measured = self.ratio if op == ">=" else self.value
        if measured is None:
            return None
        return measured >= bound if op == ">=" else measured <= bound

    def cells(self) -> tuple[str, ...]:
        value = f"{self.value:,.0f} {self.unit}"
        baseline = (f"{self.baseline:,.0f} {self.unit} ({self.baseline_name})"
                    if self.baseline is not None else "—")
        ratio = f"{self.ratio:.2f}x" if self.ratio is not None else "—"
        if self.target is None:
            target = "—"
        elif self.target[0] == ">=":
            target = f"≥ {self.target[1]:g}x"
        else:
            target = f"≤ {self.target[1]:,g} {self.unit}"
        met = {None: "—", True: "met", False: "**not met**"}[self.met]
        return self.name, value, baseline, ratio, target, met


def markdown_table(figures: list[Figure]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(f.cells()) + " |" for f in figures]
    return "\n".join(lines)


def text_table(figures: list[Figure]) -> str:
    """The same table for the terminal: aligned columns, no Markdown emphasis."""
    rows = [HEADER] + [tuple(c.replace("**", "") for c in f.cells()) for f in figures]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    out = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
           for row in rows]
    out.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(out)


def round_ratios(runs: dict[str, list[float]], pairs: list[tuple[str, str]]) -> str:
    """Each (figure, baseline) of ``pairs`` as its ratios round by round: interleaved rounds
    drift together, so a round's ratio is a paired figure beside the ratio of medians that
    the table judges by."""
    return "Round by round: " + "; ".join(
        f"{name} " + " / ".join(f"{value / base:.2f}x"
                                for value, base in zip(runs[name], runs[baseline], strict=True))
        + f" (of {baseline})" for name, baseline in pairs) + "."


def replace_block(document: str, block: str, name: str = "make bench",
                  title: str = "`make bench`: the issue 10 targets in one run") -> str:
    """``document`` with the text between ``name``'s markers replaced by ``block``; everything
    else is kept byte for byte. Without markers, a new section goes before the first ``## ``."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    inner = f"{begin}\n{block.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _match: inner, document, count=1)
    section = f"## {title}\n\n{inner}\n\n"
    at = document.find("\n## ")
    if at < 0:
        return document.rstrip("\n") + "\n\n" + section
    return document[:at + 1] + section + document[at + 1:]
