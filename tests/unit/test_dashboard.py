"""deploy/grafana/outbox.json: every panel's PromQL parses and reads only series the relay,
the sweeper or Prometheus's scrapes produce, every outbox metric is on some panel, and the
panels are laid out on Grafana's 24-column grid without overlapping."""

from __future__ import annotations

import json
import re
from itertools import combinations
from typing import Any

import pytest

from tests.monitoring import DEPLOY, exported_families, scrape_jobs, selectors, unknown_series

DASHBOARD: dict[str, Any] = json.loads((DEPLOY / "grafana" / "outbox.json").read_text())
#: Grafana's built-in interval variables, as Grafana would fill them in.
BUILT_IN = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too; rows themselves are no panels."""
    found = []
    for panel in DASHBOARD["panels"]:
        found += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return found


def variables() -> dict[str, str]:
    values = {v["name"]: v["query"] for v in DASHBOARD["templating"]["list"]
              if v["type"] != "datasource"}
    return {**values, **BUILT_IN}


def expand(expr: str) -> str:
    """The query as Grafana sends it, with each variable's default value."""
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables(), f"unknown variable ${name} in {expr!r}"
        return variables()[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def queries() -> list[str]:
    return [expand(target["expr"]) for panel in panels() for target in panel["targets"]]


@pytest.mark.parametrize("title", [panel["title"] for panel in panels()])
def test_every_panel_reads_series_that_are_exported(title: str) -> None:
    panel = next(p for p in panels() if p["title"] == title)
    assert panel["targets"], "a panel without a query"
    for target in panel["targets"]:
        assert unknown_series(expand(target["expr"])) == [], target["expr"]


def test_every_outbox_metric_is_on_the_dashboard() -> None:
    shown = {name for query in queries() for name, _ in selectors(query)}
    outbox_families = {family: series for family, series in exported_families().items()
                       if family.startswith("outbox_")}
    assert outbox_families, "no outbox metric found in the registry"
    missing = [family for family, series in outbox_families.items() if not series & shown]
    assert missing == []


def test_the_dashboard_shows_which_relays_and_sweepers_are_up() -> None:
    up_jobs = {labels.get("job") for query in queries() for name, labels in selectors(query)
               if name == "up"}
    assert up_jobs == scrape_jobs() == {"outbox-relay", "outbox-sweeper"}


def test_a_wrong_metric_name_is_caught() -> None:
    assert unknown_series('sum(rate(outbox_messages_delivered[5m]))') == [
        "outbox_messages_delivered"]
    assert unknown_series('up{job="relays"}') == ["up{job='relays'} (no such scrape job)"]


def test_every_panel_queries_the_chosen_data_source() -> None:
    (source,) = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    for panel in panels():
        for holder in (panel, *panel["targets"]):
            assert holder["datasource"] == {"type": "prometheus", "uid": f"${{{source['name']}}}"}


def test_panels_have_unique_ids_and_titles() -> None:
    every = DASHBOARD["panels"] + [p for row in DASHBOARD["panels"] for p in row.get("panels", [])]
    ids = [panel["id"] for panel in every]
    titles = [panel["title"] for panel in panels()]
    assert len(ids) == len(set(ids)) and len(titles) == len(set(titles))


def test_panels_fit_the_grid_without_overlapping() -> None:
    boxes = [(p["title"], p["gridPos"]) for p in DASHBOARD["panels"]]
    for title, box in boxes:
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, title
    for (a, one), (b, other) in combinations(boxes, 2):
        apart = (one["x"] + one["w"] <= other["x"] or other["x"] + other["w"] <= one["x"]
                 or one["y"] + one["h"] <= other["y"] or other["y"] + other["h"] <= one["y"])
        assert apart, f"{a!r} overlaps {b!r}"
