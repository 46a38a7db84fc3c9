"""Plans of the relay's hot statements: they read what their batch needs, however the
tables grow and however often they run."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, NullPool, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.dev import services as devservices
from outbox.schema import SHARDS
from outbox.settings import sqlalchemy_url
from tests.conftest import ranges, use_ranges


def rows_read(plan: dict[str, Any], table: str = "message") -> int:
    """Rows an EXPLAIN ANALYZE plan read from ``table`` (or its partitions), over all loops."""
    read = 0
    if str(plan.get("Relation Name", "")).startswith(table) and "Actual Rows" in plan \
            and plan["Node Type"] not in ("Delete", "Update", "Insert", "ModifyTable"):
        read += (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
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


def test_the_fetch_reads_its_batch_not_the_retained_history(
        engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Joined as a set, the relay's fetch merge-joined `pending` with every partition of
    `message`, walking all retained history below the first pending id: 0.4 s a batch at
    300,000 delivered rows, and the relay fell behind under load. It must read by key."""
    use_ranges(engine, schema, 300, ahead=12)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x" * 200, key=f"k{i % 50}") for i in range(3000)]
    with engine.begin() as conn:
        store.mark_delivered(conn, schema, "test", [(i, 0, n) for n, i in enumerate(ids[:2900])])
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    with engine.connect() as conn:
        batch = store.fetch_deliverable(conn, schema, range(SHARDS), 2000)
    assert [row.id for row in batch] == ids[2900:]
    plan = explained(engine, schema, "fetch_deliverable", {
        "shards": store.int_array(range(SHARDS)), "limit": 2000, "in_flight": store.int_array(()),
        "held": [],
        "max_bytes": 1 << 24})
    assert len(ranges(engine, schema)) >= 11
    assert rows_read(plan) <= 2 * 100, plan


def test_the_outbox_processes_run_without_jit_and_with_custom_plans(
        services: devservices.Services) -> None:
    """Their lookups into partitioned tables are priced past ``jit_above_cost``: the fetch
    above compiled for 1.3 s over 43 partitions to run for 9 ms."""
    made = store.engine(sqlalchemy_url(services.database_url))
    try:
        with made.connect() as conn:
            assert conn.execute(text("SHOW jit")).scalar_one() == "off"
            assert conn.execute(text("SHOW plan_cache_mode")).scalar_one() == "force_custom_plan"
    finally:
        made.dispose()


def test_the_fetch_is_planned_for_its_parameters_however_often_it_runs(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """psycopg prepares a statement on its fifth run; five runs later PostgreSQL chose a
    generic plan for the fetch, which compared every pending row with every id in flight
    (1.5 s a batch at a 50,000-message backlog): the relay fell from 20k msg/s to 2k."""
    with Session(engine) as session, session.begin():
        for i in range(400):
            outbox.publish(session, topic, b"x", key=f"k{i % 50}")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    made = store.engine(sqlalchemy_url(services.database_url), poolclass=NullPool)
    try:
        with made.connect() as conn:
            in_flight: list[int] = []
            for _ in range(20):
                batch = store.fetch_deliverable(conn, schema, range(SHARDS), 10,
                                                in_flight=in_flight)
                assert batch, "the backlog lasts all 20 fetches"
                in_flight += [row.id for row in batch]
            plans = conn.execute(text(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE :fetch"), {"fetch": f"%FROM {schema}.pending AS p%"}).all()
    finally:
        made.dispose()
    assert len(plans) == 1, plans
    assert plans[0].generic_plans == 0 and plans[0].custom_plans >= 10, plans[0]


def test_recording_a_batch_reads_its_rows_not_the_backlog(
        engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Joined with the acks as a set, the DELETE of delivered pending rows hash-joined them
    with every pending row: 10 ms of a batch's 20 at a 50,000-message backlog, growing with
    it. It must delete by key; so must the relay's failure count."""
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x", key=f"k{i % 50}") for i in range(3000)]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    acked = ids[:150]  # a batch of 2,000 at a 40,000 backlog
    plan = explained(engine, schema, "mark_delivered", {
        "ids": store.int_array(acked), "partitions": store.int_array([0] * len(acked)),
        "offsets": store.int_array(acked), "actor": "test"})
    assert rows_read(plan, "pending") <= len(acked), plan
    plan = explained(engine, schema, "record_failures", {
        "ids": store.int_array(acked), "errors": ["no"] * len(acked),
        "permanent": [True] * len(acked),
        "actor": "test", "max_attempts": 3})
    assert rows_read(plan, "pending") <= len(acked), plan
