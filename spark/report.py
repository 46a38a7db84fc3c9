"""The short human-readable report of a run, rendered from its summary (summary.json)."""

from __future__ import annotations

from typing import Any


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def render(summary: dict[str, Any]) -> str:
    window = summary["window"]
    counts = summary["counts"]
    lines = [
        f"outbox reconciliation run {summary['run_id']}: {summary['outcome']}",
        f"window    {window['since'] or 'beginning'} .. {window['until']} ({window['source']})",
        f"read      {_n(counts['messages'])} messages, {_n(counts['op_records'])} op records, "
        + (f"{_n(counts['carried_in'])} carried over from earlier runs, "
           if counts.get("carried_in") else "")
        + (f"{_n(counts['kafka_records'])} Kafka records" if summary["read_topics"]
           else "topics not read (tables only)"),
        "findings  count / fail above",
    ]
    for f in summary["findings"]:
        if not f["checked"]:
            lines.append(f"  {'':5} {f['name']:32} not checked without --read-topics")
            continue
        mark = "FAIL" if f["exceeded"] else ("note" if f["count"] else "ok")
        threshold = "report only" if f["threshold"] is None else str(f["threshold"])
        ids = ", ".join(str(i) for i in f["sample_ids"])
        more = ", ..." if f["count"] > len(f["sample_ids"]) else ""
        lines.append(f"  {mark:5} {f['name']:32} {_n(f['count']):>9} / {threshold}"
                     + (f"  ids: {ids}{more}" if ids else ""))
    stats = summary["stats"]
    for lat in stats["latency_seconds"]:
        if lat["topic"] == "*":
            lines.append(
                f"latency   created -> delivered: p50 {_seconds(lat.get('p50'))}, "
                f"p90 {_seconds(lat.get('p90'))}, p99 {_seconds(lat.get('p99'))}, "
                f"max {_seconds(lat['max'])} ({_n(lat['delivered'])} delivered)")
    by_topic: dict[str, list[str]] = {}
    for c in stats["counts"]:
        by_topic.setdefault(c["topic"], []).append(
            f"{c['resolution']}/{c['status']} {_n(c['count'])}")
    for topic, parts in by_topic.items():
        lines.append(f"topic     {topic}: {', '.join(parts)}")
    checks = [f"{h['check_count']}: {_n(h['messages'])}" for h in stats["check_backs"]
              if h["check_count"]]
    if checks:
        lines.append(f"checked   check-backs per message: {'; '.join(checks)}")
    if counts.get("carried_out"):
        lines.append(f"carried   {_n(counts['carried_out'])} messages still open: the next run "
                     "judges them again")
    lines.append(f"output    {summary['output_path']}")
    return "\n".join(lines) + "\n"
