"""A throughput A/B of two revisions of the relay, alternated on one pair of services.

    python bench/drain_ab.py OLD NEW [--rounds 3] [--messages 50000] [--client kafka-python]

OLD and NEW are git revisions, or ``WORKTREE``, packaged as bench/latency_ab.py does (each
side's relay imports its own package, its schema migrated by its own code). Each round (the
sides in turn, as latency_ab.in_turn orders them), one relay of each side drains
``--messages`` committed 1 KiB rows (relay_bench.relay_throughput), and raw kafka-python
produce of as many records measures the machine that round, so a round on a slower minute
reads as one. Printed per round: each side's rate and its ratio to that round's raw rate;
then the medians. A warm-up drain by each side comes first, not counted: without it the
second run of round 1 was the slowest every time (BENCHMARKS.md, "Latency, session 21").
Prints only.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from latency_ab import ab_parser, in_turn, packaged, side_env
from relay_bench import raw_produce, relay_throughput, say
from soak import fresh_services

from outbox.dev.topics import create_topic


def main() -> None:
    parser = ab_parser(__doc__, rounds=3)
    parser.add_argument("--messages", type=int, default=50_000)
    args = parser.parse_args()
    sides = {"old": args.old, "new": args.new}
    ratios: dict[str, list[float]] = {"old": [], "new": []}
    with packaged(sides) as packages, fresh_services(pool_size=10) as (services, engine):

        def drain(path: Path, tag: str) -> float:
            return relay_throughput(services, engine, side_env(path, services.env()), 1,
                                    args.messages, client=args.client, tag=tag)

        for side, path in packages.items():  # a first run of each is slower: not counted
            say(f"warm-up {side}: {drain(path, f'{side}0'):,.0f} msg/s (not counted)")
        for n in range(1, args.rounds + 1):
            topic = f"drain-ab-raw-{n}"
            create_topic(services.kafka_bootstrap, topic, partitions=6)
            raw = raw_produce(services.kafka_bootstrap, topic, args.messages)
            line = [f"round {n}: raw kafka-python {raw:,.0f} msg/s"]
            for side, path in in_turn(packages, n):
                rate = drain(path, f"{side}{n}")
                ratios[side].append(rate / raw)
                line.append(f"{side} {rate:,.0f} msg/s ({rate / raw:.2f}x)")
            say(", ".join(line))
    for side, revision in sides.items():
        say(f"{side} ({revision}): median {statistics.median(ratios[side]):.2f}x raw over "
            f"{len(ratios[side])} rounds")


if __name__ == "__main__":
    main()
