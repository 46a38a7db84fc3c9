"""The relay's latency histogram, observed a batch at a time, exposes what the Prometheus
client's own Histogram exposes for the same values; the metrics are served where the log
says."""

from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox.relay.daemon import serve_metrics
from outbox.relay.metrics import LATENCY, BatchHistogram

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def exposed(registry: CollectorRegistry) -> dict[str, float]:
    lines = generate_latest(registry).decode().splitlines()
    samples = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples if not name.endswith("_created")}


def test_observing_a_batch_exposes_what_one_value_at_a_time_does() -> None:
    batches = [[0.0004, 0.001, 0.0010001, 0.003, 7.5], [], [60, 61, 1e9, 0.0025], [2.5] * 7]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("latency_seconds", "help", BOUNDS, registry=ours)
    one_by_one = Histogram("latency_seconds", "help", buckets=BOUNDS, registry=theirs)
    for batch in batches:
        batched.observe_all(iter(batch))  # any iterable, read once
        for value in batch:
            one_by_one.observe(value)
    expected = exposed(theirs)
    assert expected['latency_seconds_bucket{le="0.001"}'] == 2, "a bound holds its equal"
    assert expected['latency_seconds_bucket{le="+Inf"}'] == 16
    got = exposed(ours)
    assert got.keys() == expected.keys()
    assert all(abs(got[name] - value) <= 1e-9 * abs(value) for name, value in expected.items())


def test_the_relay_s_latency_series_keeps_its_name_and_buckets() -> None:
    registry = CollectorRegistry()
    registry.register(LATENCY)
    names = exposed(registry)
    assert {'outbox_delivery_latency_seconds_bucket{le="0.001"}',
            'outbox_delivery_latency_seconds_bucket{le="60.0"}',
            'outbox_delivery_latency_seconds_bucket{le="+Inf"}',
            "outbox_delivery_latency_seconds_count",
            "outbox_delivery_latency_seconds_sum"} <= names.keys()
    assert len([name for name in names if "_bucket" in name]) == len(BOUNDS) + 1


def test_metrics_on_port_0_are_served_where_the_log_says(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """OUTBOX_RELAY_METRICS_PORT=0 served on a port the system picked and no line named."""
    with caplog.at_level(logging.INFO, "outbox.relay"):
        port = serve_metrics(0, logging.getLogger("outbox.relay"), "127.0.0.1")
    assert f"serving metrics on http://127.0.0.1:{port}/metrics" in caplog.text
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert b"outbox_relay_owned_shards" in reply.read()
