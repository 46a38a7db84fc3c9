"""The relays' and sweepers' own view: their Prometheus endpoints (``console_metrics_urls``),
read when the page loads, each with a short timeout so a dead one cannot stall the page."""

from __future__ import annotations

import http.client
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_SECONDS = 1.0
MAX_BYTES = 16 << 20  #: read of a reply at most (a wrong URL may serve a large file)
#: What the page shows of each endpoint: a sample name and how to label it.
SHOWN = {
    "outbox_relay_owned_shards": "shards owned",
    "outbox_messages_delivered_total": "delivered",
    "outbox_messages_parked_total": "parked",
    "outbox_delivery_failures_total": "delivery failures",
    "outbox_check_backs_total": "check-backs",
    "outbox_messages_discarded_total": "discarded",
    "outbox_unchecked_messages": "unchecked (no checker)",
}

SWEEPER_SHOWN = ("check-backs", "discarded", "unchecked (no checker)")


@dataclass
class Endpoint:
    url: str
    up: bool
    kind: str = "?"
    values: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def scrape_all(urls: list[str]) -> list[Endpoint]:
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        return list(pool.map(scrape, urls))


def scrape(url: str) -> Endpoint:
    """One endpoint's shown samples, summed over their labels; down with the reason (one
    wrong URL must not take the page down with it)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as reply:
            body = reply.read(MAX_BYTES).decode()
    except http.client.HTTPException as exc:  # a port that answers, but not HTTP
        return Endpoint(url, up=False, error=f"does not answer HTTP ({type(exc).__name__})")
    except (OSError, ValueError) as exc:
        return Endpoint(url, up=False, error=str(getattr(exc, "reason", exc)))
    values: dict[str, float] = {}
    families = set()
    try:
        for family in text_string_to_metric_families(body):
            families.add(family.name)
            for sample in family.samples:
                if sample.name in SHOWN and math.isfinite(sample.value):
                    label = SHOWN[sample.name]
                    values[label] = values.get(label, 0.0) + sample.value
    except (ValueError, IndexError, TypeError) as exc:  # a page that is not a /metrics
        return Endpoint(url, up=False, error=f"not Prometheus metrics ({exc})"[:200])
    # A sweeper's process also registers the relay's metrics (it imports their module).
    kind = ("sweeper" if "outbox_check_backs" in families
            else "relay" if "outbox_relay_owned_shards" in families else "?")
    if kind == "sweeper":
        values = {k: v for k, v in values.items() if k in SWEEPER_SHOWN}
    return Endpoint(url, up=True, kind=kind, values=values)
