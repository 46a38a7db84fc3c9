"""What a publish that writes one row would cost: the floor of the publish target's redesign.

    python bench/publish_floor.py [--rounds 3] [--seconds 5] [--clients 4 16]

Today's publish writes two rows (the message and its pending row, ``publish_message()``).
This measures, on one fresh durable embedded PostgreSQL, pgbench's business INSERT alone and
next to it, in rotating order each round:

* ``built``: + the publish as built (two rows);
* ``one row``: + a prototype of the same function that writes the message row only (no
  pending row: the design where the relay finds new rows in ``message`` itself);
* ``one row + xid``: the same, with the message's transaction id in an indexed column (what
  a relay would need to find committed rows by snapshot, as PgQ does, without skipping late
  commits);
* ``one row, no function``: the message row by a plain INSERT (no function, no locks);
* ``one statement``: the publish as built and the business INSERT in one statement (a CTE):
  one round trip fewer;
* ``2nd INSERT``: a second business INSERT instead of a publish (any one more row's cost).

Each as TPS and as a ratio to the INSERT alone of that round (durable commits, no relay:
nothing notifies), then the medians. Then each statement's own time in the backend (5,000
in a plpgsql loop, rolled back: no round trip, no commit), alternated: where a publish's
time goes inside PostgreSQL. Prototypes are built in their own schemas from the installed
function's text; nothing of the product changes. Prints only. ``--backend-only``: only the
backend's times, in one transaction and then each statement in a transaction of its own
(asynchronous commit: the transaction's start, its locks and its commit without the disk).
"""

from __future__ import annotations

import argparse
import re
import statistics

from publish_ab import PUBLISH_CALL, looped
from publish_bench import pgbench_script, pgbench_tps
from relay_bench import BUSINESS, BUSINESS_TABLE, say
from soak import fresh_services
from sqlalchemy import Engine, text

from outbox import migrate

#: Each side's schema (migrated to head); the 2nd INSERT's is the built one's.
SCHEMAS = {"built": "floor_built", "one row": "floor_one", "one row + xid": "floor_xid",
           "one row, no function": "floor_one", "one statement": "floor_built",
           "2nd INSERT": "floor_built"}
SIDES = tuple(SCHEMAS)
#: The message row as a plain INSERT: what the function's first INSERT writes.
PLAIN_ROW = ("INSERT INTO {schema}.message (producer_group, topic, key, payload, content_type, "
             "shard) VALUES (:producer_group, :topic, CAST(:n AS bytea), :payload, "
             ":content_type, CAST(:shard AS smallint))")


def one_row_function(engine: Engine, schema: str) -> None:
    """``publish_one()`` in ``schema``: its ``publish_message()`` without the pending row."""
    with engine.begin() as conn:
        source = conn.execute(text("SELECT pg_get_functiondef(CAST(:f AS regproc))"),
                              {"f": f"{schema}.publish_message"}).scalar_one()
        pending = re.compile(rf"\n\s*INSERT INTO {schema}\.pending.*?;", re.S)
        assert pending.search(source), source
        prototype = pending.sub("", source).replace("publish_message", "publish_one")
        conn.execute(text(prototype.replace(":", r"\:")))


def with_xid(engine: Engine, schema: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {schema}.message ADD COLUMN txid xid8 NOT NULL "
                          "DEFAULT pg_current_xact_id()"))
        conn.execute(text(f"CREATE INDEX ON {schema}.message (txid)"))


def scripts() -> dict[str, str]:
    """Each side's pgbench transaction."""
    built = pgbench_script(SCHEMAS["built"], publish=True)
    one_row = {side: pgbench_script(SCHEMAS[side], publish=True).replace(
        f"{SCHEMAS[side]}.publish_message(", f"{SCHEMAS[side]}.publish_one(")
        for side in ("one row", "one row + xid")}
    bare = pgbench_script(SCHEMAS["built"], publish=False)
    business, publish = (statement for statement in built.split(";\n")
                         if statement.startswith(("INSERT", "SELECT")))
    return {
        "built": built,
        **one_row,
        "one row, no function": bare.replace(
            "COMMIT;", PLAIN_ROW.format(schema=SCHEMAS["one row, no function"]) + ";\nCOMMIT;"),
        # the business row and the publish in one statement: one round trip fewer
        "one statement": bare.replace(
            business, f"WITH business AS ({business}) {publish}"),
        "2nd INSERT": pgbench_script(SCHEMAS["2nd INSERT"], publish=False, inserts=2),
    }


def untriggered(engine: Engine, schema: str) -> None:
    """``{schema}.untriggered``: a copy of ``pending`` (its columns' types, its indexes)
    without the trigger that checks a row inserted by any role but the function's owner."""
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.untriggered (LIKE {schema}.pending "
                          "INCLUDING DEFAULTS INCLUDING INDEXES)"))


def statements() -> dict[str, str]:
    """What :func:`backend` times, as plpgsql statements of a loop over ``i``."""
    built, one = SCHEMAS["built"], SCHEMAS["one row"]
    pending_row = ("(message_id, shard, topic, key, producer_group, status, resolution, "
                   "deliver_after, next_check_at, created_at) VALUES (i, CAST(i % 64 AS "
                   "smallint), 'orders', NULL, 'bench', 'PENDING', 'COMMIT', now(), NULL, now())")
    return {
        "business INSERT": BUSINESS.text.replace(":c", "'c'"),
        "publish as built": PUBLISH_CALL.format(schema=built, function="publish_message"),
        "one-row publish": PUBLISH_CALL.format(schema=one, function="publish_one"),
        "message row INSERT": (
            f"INSERT INTO {one}.message (producer_group, topic, key, payload, content_type, "
            "shard) VALUES ('bench', 'orders', NULL, CAST('x' AS bytea), 'application/json', "
            "CAST(i % 64 AS smallint))"),
        "pending row INSERT": f"INSERT INTO {one}.pending {pending_row}",
        "pending row INSERT, no trigger": f"INSERT INTO {one}.untriggered {pending_row}",
        "nothing (PERFORM 1)": "PERFORM 1",
    }


def backend(engine: Engine, rounds: int) -> None:
    """Each of :func:`statements` timed in the backend, the statements in turn (reversed in
    every other round): many in one transaction, then each in a transaction of its own."""
    timed = statements()
    for commit_each, what in ((False, "in one transaction, rolled back"),
                              (True, "each in a transaction of its own")):
        took: dict[str, list[float]] = {name: [] for name in timed}
        for n in range(rounds):
            for name in (list(timed) if n % 2 == 0 else list(timed)[::-1]):
                with engine.begin() as conn:  # committed pending rows keep their ids
                    conn.execute(text(f"TRUNCATE {SCHEMAS['one row']}.pending, "
                                      f"{SCHEMAS['one row']}.untriggered"))
                took[name].append(looped(engine, timed[name], commit_each))
        say(f"in the backend, µs a statement {what} (median; each round):")
        for name, values in took.items():
            say(f"  {name:32} {statistics.median(values):5.1f}  "
                f"({', '.join(f'{v:.1f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="of pgbench, a run")
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--backend-only", action="store_true",
                        help="only the statements' own time in the backend, no pgbench")
    args = parser.parse_args()
    with fresh_services(pool_size=2) as (services, engine):
        for schema in set(SCHEMAS.values()):
            migrate.upgrade(services.database_url, schema)
        for side in ("one row", "one row + xid"):
            one_row_function(engine, SCHEMAS[side])
        with_xid(engine, SCHEMAS["one row + xid"])
        untriggered(engine, SCHEMAS["one row"])
        with engine.begin() as conn:
            conn.execute(text(BUSINESS_TABLE))
        if args.backend_only:
            backend(engine, args.rounds)
            return
        bare = pgbench_script(SCHEMAS["built"], publish=False)
        by_side = scripts()
        ratios: dict[tuple[str, int], list[float]] = {
            (side, c): [] for side in SIDES for c in args.clients}
        for n in range(args.rounds):
            order = SIDES[n % len(SIDES):] + SIDES[:n % len(SIDES)]
            for clients in args.clients:
                alone = pgbench_tps(services, clients, args.seconds, bare, SCHEMAS["built"])
                line = f"round {n + 1}, {clients:2} clients: INSERT alone {alone:7,.0f} TPS"
                for side in order:
                    tps = pgbench_tps(services, clients, args.seconds, by_side[side],
                                      SCHEMAS[side])
                    ratios[side, clients].append(tps / alone)
                    line += f"; {side} {tps:7,.0f} ({tps / alone:.2f}x)"
                say(line)
        say("medians, of the INSERT alone:")
        for clients in args.clients:
            say(f"  {clients:2} clients: " + ", ".join(
                f"{side} {statistics.median(ratios[side, clients]):.2f}x" for side in SIDES))
        backend(engine, args.rounds)


if __name__ == "__main__":
    main()
