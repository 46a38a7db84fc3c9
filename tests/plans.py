"""What a statement's plan read, and the rows to plan it on."""

from __future__ import annotations

import re
from typing import Any

from psycopg import sql
from sqlalchemy import Engine, text

from outbox import store


def rows_read(plan: dict[str, Any], table: str = "message") -> int:
    """Rows an EXPLAIN ANALYZE plan read from ``table`` (or its partitions), over all loops."""
    read = 0
    if str(plan.get("Relation Name", "")).startswith(table) and "Actual Rows" in plan \
            and plan["Node Type"] not in ("Delete", "Update", "Insert", "ModifyTable"):
        read += (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
                 + plan.get("Rows Removed by Index Recheck", 0)) * plan["Actual Loops"]
    return read + sum(rows_read(child, table) for child in plan.get("Plans", []))


def explained(engine: Engine, schema: str, name: str, params: dict[str, Any]) -> Any:
    """The EXPLAIN ANALYZE plan (JSON) of the named statement, run then rolled back."""
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cursor:
            sql = store.driver_sql(store.query(name, schema))
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            plan = cursor.fetchone()[0][0]["Plan"]
        raw.rollback()
    finally:
        raw.close()
    return plan


def queue(engine: Engine, schema: str, topic: str, n: int, shards: int = 1) -> list[int]:
    """``n`` committed messages with their pending rows, 50 keys, written in one statement;
    each key on shard (key number % ``shards``)."""
    with engine.begin() as conn:
        return list(conn.execute(text(f"""
            WITH written AS (
                INSERT INTO {schema}.message (topic, key, payload, content_type, shard)
                SELECT :topic, convert_to('k' || (i % 50), 'UTF8'), :payload, 'text/plain',
                       i % 50 % :shards
                FROM generate_series(1, :n) AS i
                RETURNING id, topic, key, shard, created_at)
            INSERT INTO {schema}.pending
                (message_id, shard, topic, key, producer_group, status, resolution, created_at)
            SELECT id, shard, topic, key, 'default', 'PENDING', 'COMMIT', created_at
            FROM written
            RETURNING message_id"""),
            {"topic": topic, "payload": b"x" * 200, "n": n, "shards": shards}).scalars())


def explained_prepared(engine: Engine, schema: str, name: str, params: dict[str, Any]
                       ) -> tuple[Any, bool]:
    """The EXPLAIN ANALYZE plan (JSON) of the named statement prepared on a session of
    ``engine`` and run there, as a long-running process runs it, and whether the plan was
    generic: the session's ``plan_cache_mode`` decides (EXPLAIN of the statement itself
    always plans for its parameters). Rolled back."""
    statement = store.driver_sql(store.query(name, schema)).replace("%%", "%")
    statement = re.sub(r"--[^\n]*", "", statement)  # comments name parameters too
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda found: f"${names.index(found[1]) + 1}",
                      statement)
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cursor:
            cursor.execute(f"PREPARE explained AS {numbered}")
            cursor.execute("SELECT CAST(parameter_types AS text[]) FROM pg_prepared_statements "
                           "WHERE name = 'explained'")
            # EXECUTE's arguments as literals: a utility statement takes no parameters.
            arguments = sql.SQL(", ").join(
                sql.SQL("CAST({} AS {})").format(sql.Literal(params[n]), sql.SQL(kind))
                for n, kind in zip(names, cursor.fetchone()[0], strict=True))
            cursor.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE explained({})")
                           .format(arguments))
            plan = cursor.fetchone()[0][0]["Plan"]
            cursor.execute("SELECT generic_plans > 0 FROM pg_prepared_statements "
                           "WHERE name = 'explained'")
            generic = cursor.fetchone()[0]
        raw.rollback()
    finally:
        raw.close()
    return plan, generic
