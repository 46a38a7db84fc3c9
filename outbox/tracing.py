"""W3C trace context at ``publish`` time, stored with the message and sent as Kafka headers.

Uses the OpenTelemetry API when it is installed (``pip install transactional-outbox[tracing]``);
without it, or without an active span, nothing is added.
"""

from __future__ import annotations

try:
    from opentelemetry import propagate
except ImportError:  # tracing is optional
    propagate = None  # type: ignore[assignment]


def trace_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``/``baggage``) of the active span, if any."""
    if propagate is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
