"""Reconciliation's thresholds: defaults per finding, overridable, unknown names refused."""

from __future__ import annotations

import pytest

from outbox import findings
from outbox.exceptions import ConfigurationError
from outbox.settings import ReconcileSettings, Settings, load_settings


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


@pytest.mark.parametrize("cls", [Settings, ReconcileSettings])
def test_the_settings_refuse_a_threshold_of_no_finding(cls: type[Settings]) -> None:
    """``outbox config`` showed ``reconcile_thresholds = {'lost_messages': 0}`` as valid;
    only ``outbox reconcile``, which imports PySpark, refused it."""
    with pytest.raises(ConfigurationError,
                       match=r"reconcile_thresholds: .*unknown finding lost_messages"):
        load_settings(cls, reconcile_thresholds={"lost_messages": 0})
    with pytest.raises(ConfigurationError, match=r"reconcile_thresholds: .*must be 0 or more"):
        load_settings(cls, reconcile_thresholds={"discarded": -1})
    assert load_settings(cls, reconcile_thresholds={"discarded": 3}).reconcile_thresholds == {
        "discarded": 3}


def test_an_empty_output_folder_is_refused() -> None:
    """``--output-dir ""`` wrote the run's folder into the working directory, silently."""
    with pytest.raises(ConfigurationError, match="reconcile_output_dir: String should have at "
                       "least 1 character"):
        load_settings(ReconcileSettings, reconcile_output_dir="")
