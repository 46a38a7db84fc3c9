"""deploy/prometheus/alerts.yml: valid for Prometheus, proven by promtool's unit tests
(alerts.test.yml: input series and the alerts they must, or must not, raise), and built only
on series the relay, the sweeper or Prometheus's scrapes really produce."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.schema import SHARDS
from tests.monitoring import PROMETHEUS, promtool, unknown_series
from tests.unit.test_docs import slug

DOCS = Path(__file__).resolve().parents[2] / "docs"


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((PROMETHEUS / name).read_text())
    return document


def rules() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in load("alerts.yml")["groups"]
            for rule in group["rules"]}


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_the_rules_raise_exactly_the_alerts_their_unit_tests_expect() -> None:
    tested = promtool("test", "rules", "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    shutil.copy(PROMETHEUS / "alerts.test.yml", tmp_path)
    text = (PROMETHEUS / "alerts.yml").read_text()
    loosened = text.replace('max(outbox_messages{state="parked"}) > 0',
                            'max(outbox_messages{state="parked"}) > 5')
    assert loosened != text
    (tmp_path / "alerts.yml").write_text(loosened)

    tested = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)

    assert tested.returncode != 0
    assert "alertname: OutboxMessagesParked" in tested.stdout + tested.stderr


def test_every_alert_is_shown_firing_and_silent_by_a_unit_test() -> None:
    firing, silent = set(), set()
    for case in load("alerts.test.yml")["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == set(rules()), set(rules()) ^ firing
    assert silent == set(rules()), set(rules()) ^ silent


@pytest.mark.parametrize("alert", sorted(rules()))
def test_every_alert_reads_series_that_are_exported(alert: str) -> None:
    assert unknown_series(rules()[alert]["expr"]) == []


@pytest.mark.parametrize("alert", sorted(rules()))
def test_every_alert_has_a_severity_and_a_runbook_section(alert: str) -> None:
    rule = rules()[alert]
    assert rule["labels"]["severity"] in {"critical", "warning"}
    page, _, anchor = rule["annotations"]["runbook"].partition("#")
    assert page == "docs/operations.md"
    headings = re.findall(r"^#+ (.+)$", (DOCS / "operations.md").read_text(), re.MULTILINE)
    assert anchor in {slug(heading) for heading in headings}, f"no section #{anchor}"


def test_the_uncovered_shards_alert_counts_every_shard() -> None:
    rule = rules()["OutboxShardsUncovered"]
    assert rule["expr"].endswith(f"< {SHARDS}")
    assert f"of {SHARDS} shards" in rule["annotations"]["summary"]
