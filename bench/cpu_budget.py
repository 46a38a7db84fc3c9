"""Where the CPU goes at a steady publish rate: per process group and per statement.

    python bench/cpu_budget.py [--rate 1000] [--seconds 45] [--client confluent]

Fresh durable embedded services with ``pg_stat_statements`` loaded (planning tracked too);
``--rate`` messages a second from soak.py's publishers (4 threads, one 1 KiB message per
transaction) and one relay delivering them. Over a window in the middle of the run it prints
the CPU cores each group of processes used (the relay, the PostgreSQL backends serving it,
those serving the publishers, the broker, the publishing process), how long each group's
threads were ready to run but waited for a core, and the statements by server time,
planning apart from execution: what the latency target competes with for the machine's
cores. Prints only (BENCHMARKS.md quotes it by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

from relay_bench import cpu_seconds, delivered, running, say, start_relays, stop
from soak import PARTITIONS, fresh_services, publish_at_rate
from sqlalchemy import Engine, text

from outbox import Outbox, migrate, store
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic


def waited_seconds(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent ready to run but waiting for a core (the
    scheduler's run-queue time, ``/proc/<pid>/task/*/schedstat``); 0 once it is gone."""
    waited = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        with contextlib.suppress(OSError):
            waited += int((task / "schedstat").read_text().split()[1])
    return waited / 1e9


class Statement(NamedTuple):
    """One statement's totals over the window (times in ms)."""

    name: str
    calls: int
    planning: float
    execution: float
    wal: int


def client_pids() -> dict[int, int]:
    """Local TCP port → the pid that owns the socket (``ss``, from iproute2)."""
    listing = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout
    owners = {}
    for line in listing.splitlines():
        found = re.search(r"pid=(\d+)", line)
        if found:
            owners[int(line.split()[3].rsplit(":", 1)[1])] = int(found.group(1))
    return owners


def groups(engine: Engine, relay: int, broker: int) -> dict[int, str]:
    """Every process to measure, named by its group; a backend by the process it serves."""
    owners = client_pids()
    named = {relay: "relay process", broker: "broker", os.getpid(): "publishing process"}
    with engine.connect() as conn:
        for pid, port, kind in conn.execute(text(
                "SELECT pid, client_port, backend_type FROM pg_stat_activity")):
            serves = owners.get(port) if port is not None else None
            named[pid] = ("PostgreSQL for the relay" if serves == relay else
                          "PostgreSQL for the publishers" if serves == os.getpid() else
                          f"PostgreSQL {kind}" if port is None else "PostgreSQL, other clients")
    return named


def statements(engine: Engine, top: int) -> list[Statement]:
    """The statements by server time, named as in queries.sql (by their first line)."""
    names = {_first_line(body): name for name, body in store._raw_queries().items()}
    found: dict[str, Statement] = {}
    with engine.connect() as conn:
        for row in conn.execute(text(
                "SELECT query, calls, total_plan_time, total_exec_time, wal_bytes "
                "FROM pg_stat_statements")):
            name = names.get(_first_line(row.query), " ".join(row.query.split())[:40])
            seen = found.get(name, Statement(name, 0, 0.0, 0.0, 0))
            found[name] = Statement(name, seen.calls + row.calls,
                                    seen.planning + row.total_plan_time,
                                    seen.execution + row.total_exec_time,
                                    seen.wal + int(row.wal_bytes))
    return sorted(found.values(), key=lambda s: -(s.planning + s.execution))[:top]


def _first_line(sql: str) -> str:
    """A statement's first line with its parameters blanked (``:name`` as written, ``$1`` as
    PostgreSQL records it)."""
    return re.sub(r":\w+|\$\d+", "?", sql.lstrip().splitlines()[0])


def load_pg_stat_statements(services: devservices.Services, engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"))
    engine.dispose()
    devservices.stop_postgres(services)
    devservices.start_postgres(services, durable=True)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CREATE EXTENSION pg_stat_statements"))
        conn.execute(text("ALTER SYSTEM SET pg_stat_statements.track_planning = on"))
        conn.execute(text("SELECT pg_reload_conf()"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=45.0, help="of publishing")
    parser.add_argument("--window", type=float, default=20.0,
                        help="seconds measured, starting a third into the run")
    parser.add_argument("--client", choices=("kafka-python", "confluent"),
                        default="kafka-python", help="the relay's Kafka transport")
    args = parser.parse_args()
    with fresh_services(pool_size=10) as (services, engine):
        load_pg_stat_statements(services, engine)
        schema = topic = "cpu_budget"
        migrate.upgrade(services.database_url, schema)
        create_topic(services.kafka_bootstrap, topic, partitions=PARTITIONS)
        env = {**os.environ, **services.env(), "OUTBOX_KAFKA_CLIENT": args.client}
        relays = start_relays(env, schema, 1)
        time.sleep(3)  # the relay is up and owns its shards
        measured: dict[str, float] = {}
        waited: dict[str, float] = {}
        window_statements: list[Statement] = []

        def measure() -> None:
            time.sleep(args.seconds / 3)
            named = groups(engine, relays[0].pid, services.tansu_pid)
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_stat_statements_reset()"))
            before = {pid: (cpu_seconds(pid), waited_seconds(pid)) for pid in named}
            started = time.monotonic()
            time.sleep(args.window)
            elapsed = time.monotonic() - started
            for pid, group in named.items():
                used = (cpu_seconds(pid) - before[pid][0]) / elapsed
                measured[group] = measured.get(group, 0.0) + used
                ready = (waited_seconds(pid) - before[pid][1]) / elapsed
                waited[group] = waited.get(group, 0.0) + ready
            window_statements.extend(statements(engine, 12))

        watcher = threading.Thread(target=measure)
        watcher.start()
        say(f"{args.rate:,} msg/s for {args.seconds:g} s, 1 relay ({args.client}); measuring "
            f"{args.window:g} s from {args.seconds / 3:g} s")
        committed = publish_at_rate(engine, Outbox(schema=schema), topic, args.rate,
                                    args.seconds)
        watcher.join()
        while delivered(engine, schema) < len(committed):
            running(relays)
            time.sleep(0.2)
        stop(relays)
    per_message = 1e6 / args.rate
    say("\ncores used over the window (µs of CPU per message), and seconds a second its threads"
        "\nwere ready to run but waited for a core:")
    for group, cores in sorted(measured.items(), key=lambda item: -item[1]):
        if cores >= 0.005:
            say(f"  {group:32s} {cores:5.2f} ({cores * per_message:4.0f} µs)   waited "
                f"{waited[group]:5.2f}")
    say(f"  {'all of the above':32s} {sum(measured.values()):5.2f} of {os.cpu_count()}"
        f"         waited {sum(waited.values()):5.2f}")
    say("\nstatements over the window, by server time (ms in all; µs per call):")
    for s in window_statements:
        calls = max(s.calls, 1)
        say(f"  {s.name:40s} {s.calls:7,} calls  planning {s.planning:6.0f} ms "
            f"({s.planning * 1000 / calls:4.0f})  execution {s.execution:6.0f} ms "
            f"({s.execution * 1000 / calls:4.0f})  WAL {s.wal / calls:5.0f} B/call")


if __name__ == "__main__":
    main()
