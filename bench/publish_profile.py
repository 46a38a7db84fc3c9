"""Where a publishing transaction's CPU goes: perf over pgbench, in µs of a core per transaction.

    python bench/publish_profile.py [--revision head] [--clients 16] [--seconds 6]

Needs ``perf`` (Debian: ``apt-get install linux-perf``) and root, as the machine-wide
profile does. On fresh durable embedded PostgreSQL, a schema at ``--revision``; three pgbench
runs of ``--clients``: the business INSERT alone, the INSERT twice (what one more small
row costs), and the INSERT + publish (relays awake: no NOTIFY). ``perf record -a -g`` samples
every CPU through the middle of each run. A share of the samples, times the CPUs, over the
transactions per second, is µs of a core per transaction: printed for pgbench, for
PostgreSQL's processes, and within them for what the publish's statement does
(``publish_message()``; its check constraints, trigger, index inserts and executor start-up),
the commit (each counting the time of what it calls), and the kernel's own time in
PostgreSQL's processes (the sockets' system calls, the WAL's writes). Prints only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

from publish_bench import BUSINESS_TABLE, pgbench_script, pgbench_tps
from relay_bench import say
from soak import fresh_services
from sqlalchemy import text

from outbox import migrate

SCHEMA = "bench_profile"
#: what the table shows within PostgreSQL's processes: label, symbol (its share counts what
#: it calls)
PARTS = (
    ("the publish statement (publish_message)", "fmgr_security_definer"),
    ("  its check constraints (ExecConstraints)", "ExecConstraints"),
    ("  its trigger (ExecBRInsertTriggers)", "ExecBRInsertTriggers"),
    ("  index inserts (ExecInsertIndexTuples)", "ExecInsertIndexTuples"),
    ("  executor start-up (standard_ExecutorStart)", "standard_ExecutorStart"),
    ("commit (CommitTransactionCommand)", "CommitTransactionCommand"),
)
KERNEL = "the kernel, for PostgreSQL (its own time)"


def process(by_dso: dict[tuple[str, str], float], name: str) -> float:
    """The share of the samples in processes named ``name``."""
    return sum(share for (comm, _dso), share in by_dso.items() if comm == name)


def shares(recorded: Path, sort: str, *options: str) -> dict[tuple[str, str], float]:
    """Percent of all samples by (process name, ``sort``'s other key), summed over copies of a
    name (perf lists a symbol once per mapping of the binary). Filtered with perf's own
    ``--comm``, the kernel's samples of PostgreSQL's processes went missing from some
    recordings, so the process name is a sort key here."""
    report = subprocess.run(["perf", "report", "-i", str(recorded), "-q", "-g", "none",
                             "--sort", f"comm,{sort}", *options],
                            capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, str], float] = defaultdict(float)
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(?:[\d.]+%\s+)?(\S+)\s+(?:\[[.k]\]\s+)?(\S.*?)\s*$",
                         line)
        if match:
            found[match[2], match[3]] += float(match[1])
    return found


def profiled(run: Callable[[], float], seconds: float, recorded: Path) -> float:
    """Run ``run`` (returning TPS) in a thread while perf samples every CPU for its middle
    ``seconds`` - 2 seconds into ``recorded``; returns its TPS."""
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(run()))
    worker.start()
    time.sleep(1)  # pgbench connected and running
    subprocess.run(["perf", "record", "-a", "-g", "-q", "-o", str(recorded), "--", "sleep",
                    f"{seconds - 2:g}"], check=True, capture_output=True)
    worker.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revision", default="head")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf)")
    cpus = os.cpu_count() or 1
    runs = {"INSERT alone": pgbench_script(SCHEMA, publish=False),
            "INSERT twice": pgbench_script(SCHEMA, publish=False, inserts=2),
            "INSERT + publish": pgbench_script(SCHEMA, publish=True)}
    with fresh_services(pool_size=2) as (services, engine), \
            tempfile.TemporaryDirectory() as folder:
        migrate.upgrade(services.database_url, SCHEMA, args.revision)
        with engine.begin() as conn:
            conn.execute(text(BUSINESS_TABLE))
        say(f"revision {args.revision}, {args.clients} pgbench clients, {cpus} CPUs; "
            f"µs of a core per transaction")
        columns: dict[str, dict[str, float]] = {}
        for label, script in runs.items():
            recorded = Path(folder, f"{len(columns)}.data")
            tps = profiled(partial(pgbench_tps, services, args.clients, args.seconds, script,
                                   SCHEMA), args.seconds, recorded)
            by_dso = shares(recorded, "dso", "--no-children")
            by_symbol = shares(recorded, "sym", "--children")
            per = cpus * 1e6 / tps / 100  # µs of a core per transaction, per percent
            columns[label] = {
                "TPS": tps,
                "all busy CPU": (100 - process(by_dso, "swapper")) * per,
                "pgbench": process(by_dso, "pgbench") * per,
                "PostgreSQL": process(by_dso, "postgres") * per,
                **{part: by_symbol.get(("postgres", symbol), 0.0) * per
                   for part, symbol in PARTS},
                KERNEL: by_dso.get(("postgres", "[kernel.kallsyms]"), 0.0) * per,
            }
        say("| | " + " | ".join(columns) + " |")
        say("|---|" + "---|" * len(columns))
        for row in next(iter(columns.values())):
            cells = [f"{c[row]:,.0f}" if row == "TPS" else f"{c[row]:.0f}"
                     for c in columns.values()]
            say(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
