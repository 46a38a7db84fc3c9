"""A latency A/B of two revisions of the relay, alternated on one pair of services.

    python bench/latency_ab.py OLD NEW [--rounds 5] [--seconds 60] [--rate 1000]
                               [--client kafka-python] [--load pgbench] [--warm-up 20]

OLD and NEW are git revisions of this repository (``HEAD``, a commit, a branch; ``WORKTREE``
for the files as they are). Each is unpacked into a package of its own; then, round after
round (old first in odd rounds, new first in even ones), a relay of each (``PYTHONPATH`` to
its package) delivers what soak.py's publishers (``--load``) commit at ``--rate`` for
``--seconds``, in a schema and topic of its own, on one pair of fresh durable services;
each side's schema is migrated by its own code. The publishers are
this checkout's (the two revisions must accept its publish statement). Printed per round:
p50, p99 and max of commit → recorded ack, and commit → Kafka ack (``ack_probe.py``); then
the medians of each side. A warm-up run of
``--warm-up`` seconds by each side comes first, not counted (``--warm-up 0``: none), as in
drain_ab.py: the first runs on fresh services may pay for what is still cold. On 2 shared
cores one revision's rounds spread over several milliseconds (BENCHMARKS.md, "Latency,
session 18"): compare medians over many rounds, and read a difference smaller than that
spread as none. Prints only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from relay_bench import say
from soak import LatencyMinute, add_load_argument, fresh_services, latency_soak

REPO = Path(__file__).resolve().parent.parent
#: Top-level folders installed as subpackages of ``outbox`` (pyproject.toml's package-dir).
SUBPACKAGES = ("relay", "spark", "migrations")
WORKTREE = "WORKTREE"
T = TypeVar("T")


def package(revision: str, into: Path) -> Path:
    """``revision``'s ``outbox`` package laid out as installed, in ``into``; the folder to
    put on ``PYTHONPATH``."""
    source = into / "source"
    if revision == WORKTREE:
        shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "__pycache__", "*.egg-info"))
    else:
        source.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", revision],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    root = into / "package"
    shutil.copytree(source / "outbox", root / "outbox")
    for name in SUBPACKAGES:
        shutil.copytree(source / name, root / "outbox" / name)
    return root


def side_env(path: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment in which a side's processes import its package. ``PYTHONSAFEPATH``:
    ``python -m outbox`` otherwise puts the current folder first on the path, and started
    from this repository's root it imported the working tree's ``outbox`` on both sides."""
    env = {**os.environ, **extra, "PYTHONPATH": str(path), "PYTHONSAFEPATH": "1"}
    found = subprocess.run([sys.executable, "-c", "import outbox; print(outbox.__file__)"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not found.startswith(str(path)):
        raise SystemExit(f"a side imports {found}, not its package in {path}")
    return env


def ab_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments both A/B scripts take: two revisions, rounds, the relay's transport."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--client", choices=("kafka-python", "confluent"),
                        default="kafka-python")
    return parser


@contextlib.contextmanager
def packaged(sides: dict[str, str]) -> Iterator[dict[str, Path]]:
    """Each side's revision as a package (:func:`package`) in a folder removed after."""
    folder = Path(tempfile.mkdtemp(prefix="outbox-ab-"))
    try:
        yield {side: package(revision, folder / side) for side, revision in sides.items()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def in_turn(packages: dict[str, T], n: int) -> list[tuple[str, T]]:
    """The sides in round ``n``'s order: old first in odd rounds, new first in even ones, so
    whatever the first run of a round leaves behind (dead rows, a warmer cache) falls on
    each side alike. (Draining the same code on both sides, the second of round 1 ran at
    0.70-0.72x raw against 0.79-0.83x for the first, BENCHMARKS.md "Latency, session 21".)"""
    sides = list(packages.items())
    return sides if n % 2 else sides[::-1]


def main() -> None:
    parser = ab_parser(__doc__, rounds=5)
    parser.add_argument("--seconds", type=float, default=60.0, help="of publishing, a round")
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--warm-up", type=float, default=20.0,
                        help="seconds of an uncounted run by each side first (0: none)")
    add_load_argument(parser)
    args = parser.parse_args()
    sides = {"old": args.old, "new": args.new}
    rounds: dict[str, list[LatencyMinute]] = {"old": [], "new": []}
    with packaged(sides) as packages, fresh_services(pool_size=10) as (services, engine):

        def run(n: int, side: str, path: Path, seconds: float) -> LatencyMinute:
            env = side_env(path, {**services.env(), "OUTBOX_KAFKA_CLIENT": args.client})
            return latency_soak(services, engine, env, args.rate, seconds / 60,
                                tag=f"_{side}_{n}", load=args.load)[0]

        if args.warm_up > 0:
            for side, path in packages.items():
                result = run(0, side, path, args.warm_up)
                say(f"warm-up {side:3}: p50 {result.p50:6.2f} ms  p99 {result.p99:6.2f} ms "
                    f"(not counted)")
        for n in range(1, args.rounds + 1):
            for side, path in in_turn(packages, n):
                result = run(n, side, path, args.seconds)
                rounds[side].append(result)
                say(f"round {n} {side:3}: p50 {result.p50:6.2f} ms  p99 {result.p99:6.2f} "
                    f"ms  max {result.worst:7.1f} ms  (to the ack: p50 {result.ack_p50:.2f} "
                    f"ms, p99 {result.ack_p99:.2f} ms; slowest disk flush "
                    f"{result.slowest_fsync:.1f} ms)")
    for side, revision in sides.items():
        say(f"{side} ({revision}): median p50 "
            f"{statistics.median(r.p50 for r in rounds[side]):.2f} ms, median p99 "
            f"{statistics.median(r.p99 for r in rounds[side]):.2f} ms over "
            f"{len(rounds[side])} rounds (to the ack: median p50 "
            f"{statistics.median(r.ack_p50 for r in rounds[side]):.2f} ms, median p99 "
            f"{statistics.median(r.ack_p99 for r in rounds[side]):.2f} ms)")


if __name__ == "__main__":
    main()
