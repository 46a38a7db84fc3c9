"""The findings a reconciliation reports and their default thresholds: plain data, so the
settings check ``reconcile_thresholds`` without PySpark (spark/findings.py finds them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from outbox.exceptions import ConfigurationError


@dataclass(frozen=True)
class Finding:
    name: str
    title: str
    #: The run fails when more than this many are found; None: reported, never fails a run.
    threshold: int | None
    #: Only found when the run reads the Kafka topics.
    needs_topics: bool = False


FINDINGS = (
    Finding("undelivered_after_sla", "committed but not delivered within the SLA", 0),
    # At-least-once delivery: a relay dying between the broker's ack and its op record sends
    # the batch again. Consumers deduplicate on outbox-id; the chaos test bounds the rate.
    Finding("delivered_more_than_once", "delivered more than once", None),
    Finding("delivered_although_rolled_back",
            "delivered although rolled back, discarded or never committed", 0),
    Finding("op_record_without_message", "op records without a prepare row", 0),
    Finding("kafka_record_without_op_record", "records in Kafka with no op record", 0,
            needs_topics=True),
    Finding("op_record_position_mismatch",
            "op records whose partition/offset does not hold that message", 0, needs_topics=True),
    Finding("key_order_broken", "per-key order broken", 0),
    # The sweeper is still checking these back: a state to watch, not an error yet.
    Finding("stuck_unknown", "rows stuck UNKNOWN past the SLA", None),
    # A designed, kept and resumable outcome of 15 inconclusive check-backs.
    Finding("discarded", "discarded rows", None),
)
BY_NAME = {finding.name: finding for finding in FINDINGS}


def thresholds(overrides: Mapping[str, int | None]) -> dict[str, int | None]:
    """The default thresholds with ``overrides`` applied; unknown names are an error."""
    unknown = sorted(set(overrides) - set(BY_NAME))
    if unknown:
        raise ConfigurationError(
            f"unknown finding {', '.join(unknown)} in thresholds; known: {', '.join(BY_NAME)}")
    negative = sorted(name for name, value in overrides.items() if value is not None and value < 0)
    if negative:
        raise ConfigurationError(f"threshold of {', '.join(negative)} must be 0 or more")
    return {f.name: overrides.get(f.name, f.threshold) for f in FINDINGS}
