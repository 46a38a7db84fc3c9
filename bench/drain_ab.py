"""A throughput A/B of two revisions of the relay, alternated on one pair of services.

    python bench/drain_ab.py OLD NEW [--rounds 3] [--messages 50000] [--client kafka-python]

OLD and NEW are git revisions, or ``WORKTREE``, packaged as bench/latency_ab.py does (each
side's relay imports its own package, its schema migrated by its own code). Each round (the
sides in turn, as latency_ab.in_turn orders them), one relay of each side drains
``--messages`` committed 1 KiB rows (relay_bench.drain), and raw kafka-python produce of
as many records measures the machine that round, so a round on a slower minute reads as one.
Printed per round: each side's rate, its ratio to that round's raw rate, the relay's CPU
time per message (from its first delivery to its last, /proc) and the new side's rate over
the old one's; then the medians, and in how many rounds the new side was ahead, to read
against chance (12 rounds of 15 or more happen by chance 1.8% of the time; BENCHMARKS.md,
"The relay's interpreter time, session 27"). A warm-up drain by each side comes first, not
counted: without it the second run of round 1 was the slowest every time (BENCHMARKS.md,
"Latency, session 21"). Prints only.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from latency_ab import ab_parser, in_turn, packaged, side_env
from relay_bench import Drained, drain, raw_produce, say
from soak import fresh_services

from outbox.dev.topics import create_topic


def main() -> None:
    parser = ab_parser(__doc__, rounds=3)
    parser.add_argument("--messages", type=int, default=50_000)
    args = parser.parse_args()
    sides = {"old": args.old, "new": args.new}
    ratios: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    paired: list[float] = []
    with packaged(sides) as packages, fresh_services(pool_size=10) as (services, engine):

        def run(path: Path, tag: str) -> Drained:
            return drain(services, engine, side_env(path, services.env()), 1, args.messages,
                         client=args.client, tag=tag)

        for side, path in packages.items():  # a first run of each is slower: not counted
            say(f"warm-up {side}: {run(path, f'{side}0').rate:,.0f} msg/s (not counted)")
        for n in range(1, args.rounds + 1):
            topic = f"drain-ab-raw-{n}"
            create_topic(services.kafka_bootstrap, topic, partitions=6)
            raw = raw_produce(services.kafka_bootstrap, topic, args.messages)
            line = [f"round {n}: raw kafka-python {raw:,.0f} msg/s"]
            rates = {}
            for side, path in in_turn(packages, n):
                drained = run(path, f"{side}{n}")
                rates[side] = drained.rate
                ratios[side].append(drained.rate / raw)
                cpu[side].append(drained.cpu / args.messages * 1e6)
                line.append(f"{side} {drained.rate:,.0f} msg/s ({drained.rate / raw:.2f}x, "
                            f"{cpu[side][-1]:.1f} µs of CPU a message)")
            paired.append(rates["new"] / rates["old"])
            say(", ".join(line) + f"; new/old {paired[-1]:.2f}")
    for side, revision in sides.items():
        say(f"{side} ({revision}): median {statistics.median(ratios[side]):.2f}x raw, "
            f"{statistics.median(cpu[side]):.1f} µs of CPU a message over "
            f"{len(ratios[side])} rounds")
    say(f"new/old in the same round: median {statistics.median(paired):.2f}, new ahead in "
        f"{sum(ratio > 1 for ratio in paired)} of {len(paired)} rounds")


if __name__ == "__main__":
    main()
