"""Reconciliation's thresholds: defaults per finding, overridable, unknown names refused."""

from __future__ import annotations

import pytest

from outbox.exceptions import ConfigurationError

# findings.py builds Spark expressions, so it imports pyspark (no JVM starts on import);
# `make test` installs the spark extra, so this is a plain import, never a skip.
from outbox.spark import findings


def test_defaults_fail_on_errors_and_only_report_states_to_watch() -> None:
    defaults = findings.thresholds({})
    assert set(defaults) == {finding.name for finding in findings.FINDINGS}
    assert defaults["undelivered_after_sla"] == 0
    assert defaults["delivered_more_than_once"] is None
    assert defaults["discarded"] is None


def test_overrides_replace_only_their_own_finding() -> None:
    overridden = findings.thresholds({"discarded": 3, "key_order_broken": None})
    assert (overridden["discarded"], overridden["key_order_broken"]) == (3, None)
    assert overridden["undelivered_after_sla"] == 0


def test_unknown_findings_and_negative_limits_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="unknown finding lost_messages in thresholds"):
        findings.thresholds({"lost_messages": 0})
    with pytest.raises(ConfigurationError, match="threshold of discarded must be 0 or more"):
        findings.thresholds({"discarded": -1})
