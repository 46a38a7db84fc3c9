"""A publish-cost A/B of two schema revisions, alternated on one fresh PostgreSQL.

    python bench/publish_ab.py OLD NEW [--rounds 5] [--seconds 5] [--clients 4 16]

OLD and NEW are Alembic revisions of this checkout (``0015``, ``head``): each side is a
schema migrated to its revision, published to by the same statement. Each round (the sides
in turn, as latency_ab.in_turn orders them), for each ``--clients``: pgbench's business
INSERT alone, then business INSERT + publish on each side (durable commits, relays awake: no
NOTIFY), as TPS and as a ratio to the INSERT alone of that round; and the server's own time
for one publish, a plpgsql loop of 5,000 publishes in one transaction, rolled back (no round
trips, no commit: what the statement costs the backend), with the WAL it wrote (after a
CHECKPOINT). Then the medians, and NEW's over OLD's. Prints only.
"""

from __future__ import annotations

import argparse
import statistics

from latency_ab import in_turn
from publish_bench import BUSINESS_TABLE, pgbench_script, pgbench_tps
from relay_bench import say
from soak import fresh_services
from sqlalchemy import Engine, text

from outbox import migrate

LOOPED = 5_000


#: A publish as a plpgsql statement of a loop over ``i`` (keyless, so no advisory lock piles
#: up); {schema} and {function} are filled in.
PUBLISH_CALL = """PERFORM {schema}.{function}(
        producer_group => 'bench', topic => 'orders', key => NULL, header_keys => NULL,
        header_values => NULL, payload => CAST('{{"customer": "c"}}' AS bytea),
        content_type => 'application/json', shard => CAST(i % 64 AS smallint),
        deliver_at => NULL, delay_seconds => 0, resolution => 'COMMIT',
        check_after_seconds => 60, lock_class => NULL, lock_key => NULL, notify => false,
        wake_class => 0, wake_base => 0, channel => '', delayed_note => '')"""


def looped(engine: Engine, statement: str, commit_each: bool = False) -> float:
    """µs per run of ``statement`` (plpgsql, which may use the loop's ``i``) inside the
    backend: ``LOOPED`` runs in one transaction, rolled back (no round trips, no commit); or
    (``commit_each``) each run a transaction of its own, committed without waiting for the
    disk (asynchronous commit): what a statement costs a transaction that starts with it."""
    commit = "COMMIT;" if commit_each else ""
    loop = f"""DO $loop$
DECLARE started timestamptz := clock_timestamp();
BEGIN
    PERFORM set_config('synchronous_commit', 'off', false);
    FOR i IN 1..{LOOPED} LOOP {statement}; {commit} END LOOP;
    PERFORM set_config('bench.elapsed', (extract(epoch FROM clock_timestamp() - started)
                                         * 1e6 / {LOOPED})::text, false);
END
$loop$"""
    with engine.connect() as conn:
        if commit_each:  # COMMIT in a DO block needs it to run outside a transaction block
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            conn.execute(text(loop.replace(":", r"\:")))
            elapsed = float(conn.execute(
                text("SELECT current_setting('bench.elapsed')")).scalar_one())
        finally:  # the timed rows (or a failed loop) undone; the connection durable again
            conn.rollback()
            conn.execute(text("RESET synchronous_commit"))
            conn.commit()
    return elapsed


def server_time(engine: Engine, schema: str) -> tuple[float, float]:
    """µs per publish inside the backend (:func:`looped`), and the WAL bytes a publish
    writes (right after a CHECKPOINT, so both sides log the same full-page images)."""
    with engine.connect() as conn:
        conn.execute(text("CHECKPOINT"))
        before = conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one()
        conn.commit()
    elapsed = looped(engine, PUBLISH_CALL.format(schema=schema, function="publish_message"))
    with engine.connect() as conn:
        wal = conn.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :before)"),
                           {"before": before}).scalar_one()
    return elapsed, float(wal) / LOOPED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0, help="of pgbench, a run")
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    sides = {"old": args.old, "new": args.new}
    with fresh_services(pool_size=2) as (services, engine):
        schemas = {side: f"bench_{side}" for side in sides}
        for side, revision in sides.items():
            migrate.upgrade(services.database_url, schemas[side], revision)
        with engine.begin() as conn:
            conn.execute(text(BUSINESS_TABLE))
        bare = pgbench_script(schemas["old"], publish=False)
        ratios = {(side, c): [] for side in sides for c in args.clients}
        looped: dict[str, list[float]] = {side: [] for side in sides}
        wal: dict[str, list[float]] = {side: [] for side in sides}
        for n in range(1, args.rounds + 1):
            order = [side for side, _revision in in_turn(sides, n)]
            for clients in args.clients:
                alone = pgbench_tps(services, clients, args.seconds, bare, schemas["old"])
                line = f"round {n}, {clients:2} clients: INSERT alone {alone:7,.0f} TPS"
                for side in order:
                    tps = pgbench_tps(services, clients, args.seconds,
                                      pgbench_script(schemas[side], publish=True),
                                      schemas[side])
                    ratios[side, clients].append(tps / alone)
                    line += f"; {side} ({sides[side]}) {tps:7,.0f} TPS {tps / alone:.2f}x"
                say(line)
            for side in order:
                elapsed, written = server_time(engine, schemas[side])
                looped[side].append(elapsed)
                wal[side].append(written)
            say(f"round {n}, in the server: " + "; ".join(
                f"{side} {looped[side][-1]:.1f} µs and {wal[side][-1]:.0f} B of WAL a publish"
                for side in order))
        say("medians:")
        for clients in args.clients:
            old, new = (statistics.median(ratios[side, clients]) for side in sides)
            say(f"  {clients:2} clients: old {old:.2f}x, new {new:.2f}x of the INSERT alone; "
                f"new / old {new / old:.2f}")
        old, new = (statistics.median(looped[side]) for side in sides)
        say(f"  in the server: old {old:.1f} µs, new {new:.1f} µs a publish; "
            f"new / old {new / old:.2f}")
        old, new = (statistics.median(wal[side]) for side in sides)
        say(f"  WAL a publish: old {old:.0f} B, new {new:.0f} B")


if __name__ == "__main__":
    main()
