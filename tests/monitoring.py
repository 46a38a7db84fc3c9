"""What the deploy/ monitoring assets are checked against: promtool, the series the relay and
the sweeper really export (read from prometheus_client's registry, not from a list kept by
hand), and the series a PromQL expression reads (parsed by PromQL's own grammar)."""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
#: The series each metric type puts on /metrics, after the family's name (OpenMetrics).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
#: Series Prometheus itself records for every scrape target.
SCRAPE_SERIES = {"up"}


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool not found: run scripts/bootstrap.sh (it installs Debian's "
                    "prometheus package, which ships promtool)")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@cache
def exported_families() -> dict[str, frozenset[str]]:
    """Every metric family the relay's and sweeper's processes can serve, with its series
    names: all of outbox.relay and the CLI are imported, so each metric they define is in
    the default registry (beside prometheus_client's own process and platform metrics)."""
    import outbox.relay

    importlib.import_module("outbox.cli")
    for module in pkgutil.iter_modules(outbox.relay.__path__, "outbox.relay."):
        importlib.import_module(module.name)
    return {family.name: frozenset(family.name + suffix for suffix in SUFFIXES[family.type])
            for family in REGISTRY.collect()}


def exported_series() -> frozenset[str]:
    return frozenset().union(*exported_families().values())


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The series an expression reads: (metric name, its equality label matchers)."""
    found: list[tuple[str, dict[str, str]]] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            equal = {m.name: m.value for m in node.matchers.matchers
                     if m.op == promql_parser.MatchOp.Equal}
            found.append((node.name, equal))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def scrape_jobs() -> set[str]:
    config: dict[str, Any] = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    return {job["job_name"] for job in config["scrape_configs"]}


def unknown_series(expr: str) -> list[str]:
    """The series an expression reads that nothing exports: neither the outbox's processes nor
    Prometheus for a job of deploy/prometheus/prometheus.yml."""
    missing = []
    for name, labels in selectors(expr):
        if name in SCRAPE_SERIES:
            if labels.get("job") not in scrape_jobs():
                missing.append(f"{name}{{job={labels.get('job')!r}}} (no such scrape job)")
        elif name not in exported_series():
            missing.append(name)
    return missing
