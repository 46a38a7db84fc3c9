"""Alembic revisions match the Core metadata, reverse cleanly and keep to their own table.

These tests run Alembic online (``schema`` is overridden below): they prove the migrations
themselves, and that the copy every other test gets (tests/conftest.py) is the same schema.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import ARRAY, Column, Connection, Engine, MetaData, inspect, text
from sqlalchemy.dialects.postgresql import DOMAIN
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import TypeEngine

from outbox import Outbox, SchemaNotMigrated, migrate, store
from outbox.checkers import Checker
from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from outbox.encoding import encode
from outbox.migrations import target_metadata
from outbox.relay.sweeper import Sweeper
from outbox.schema import DOMAINS, SHARDS, VERSION_TABLE, Resolution
from outbox.settings import Settings
from tests.conftest import (
    both_transports,
    count_status,
    drop_roles,
    drop_schema,
    fresh_schema,
    ids_with_status,
    partition_options,
    publish_orders,
    ranges,
    running,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.plans import queue
from tests.processes import run_outbox


@pytest.fixture
def schema(alembic_schema: str) -> str:
    """Migrated by Alembic online, not copied from the session's rendered script."""
    return alembic_schema


CATALOG = {
    "columns": "SELECT table_name, column_name, data_type, is_nullable, column_default, "
               "is_identity FROM information_schema.columns WHERE table_schema = :schema",
    "constraints": "SELECT t.relname, c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
                   "JOIN pg_class t ON t.oid = c.conrelid JOIN pg_namespace n "
                   "ON n.oid = c.connamespace WHERE n.nspname = :schema",
    "indexes": "SELECT tablename, indexname, replace(indexdef, :schema || '.', '') "
               "FROM pg_indexes WHERE schemaname = :schema",
    "storage": "SELECT c.relname, array_to_string(c.reloptions, ', ') FROM pg_class c "
               "JOIN pg_namespace n ON n.oid = c.relnamespace "
               "WHERE n.nspname = :schema AND c.reloptions IS NOT NULL",
    "functions": "SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prosecdef, "
                 "array_to_string(p.proconfig, ', '), replace(p.prosrc, :schema, '') "
                 "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                 "WHERE n.nspname = :schema",
    "triggers": "SELECT t.tgname, replace(pg_get_triggerdef(t.oid), :schema || '.', '') "
                "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = :schema AND NOT t.tgisinternal",
}


def catalog(engine: Engine, schema: str) -> dict[str, set[tuple[object, ...]]]:
    """Columns, constraints, indexes, storage parameters, functions, triggers and rows of a
    schema, with its name left out."""
    with engine.connect() as conn:
        found = {what: {tuple(row) for row in conn.execute(text(sql), {"schema": schema})}
                 for what, sql in CATALOG.items()}
        for table in (VERSION_TABLE, "relay_lease", "relay_member", "message"):
            found[table] = {tuple(row) for row in conn.execute(text(
                f"SELECT * FROM {schema}.{table}"))}
    return found


@pytest.fixture
def copied_schema(engine: Engine, migration_script: str) -> Iterator[str]:
    with fresh_schema(engine, migration_script, prefix="c") as name:
        yield name


def test_the_tests_schema_copy_is_what_alembic_builds(engine: Engine, schema: str,
                                                       copied_schema: str) -> None:
    built = catalog(engine, schema)
    assert built["indexes"] and len(built["relay_lease"]) == SHARDS
    assert catalog(engine, copied_schema) == built


def partitions(engine: Engine, schema: str) -> set[str]:
    """The partitions of the schema's tables (the metadata declares only their parents)."""
    with engine.connect() as conn:
        return set(conn.execute(text(
            "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND c.relispartition AND c.relkind = 'r'"
        ), {"schema": schema}).scalars())


def assert_on_topic_in_key_order(services: devservices.Services, topic: str,
                                 ids: list[int]) -> None:
    """The topic holds exactly the messages ``ids``, each key's (publish_orders' k0-k2) in
    id order."""
    records = read_topic(services.kafka_bootstrap, topic)
    assert sorted(r.message_id for r in records) == ids
    for key in ("k0", "k1", "k2"):
        keyed = [r.message_id for r in records if r.key == key.encode()]
        assert keyed == sorted(keyed), f"key {key} delivered in order"


def test_migrated_schema_matches_the_metadata(engine: Engine, schema: str) -> None:
    in_schema = MetaData()
    for table in target_metadata().sorted_tables:
        table.to_metadata(in_schema, schema=schema)
    parts = partitions(engine, schema)
    assert {"message_default", "op_record_default", "message_p0", "op_record_p0"} <= parts
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={"include_schemas": True,
                  "include_name": lambda name, kind, _: (
                      name == schema if kind == "schema" else name not in parts),
                  "compare_type": domain_over_declared_type},
        )
        diff = [d for d in compare_metadata(context, in_schema)
                if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []


def domain_over_declared_type(_context: MigrationContext, inspected: Column[Any],
                              declared: Column[Any], inspected_type: TypeEngine[Any],
                              declared_type: TypeEngine[Any]) -> bool | None:
    """The columns of ``DOMAINS`` are declared with their domain's base type (what clients read
    and write): the same when the database has that domain over that type, else Alembic's own
    comparison."""
    domain = DOMAINS.get((declared.table.name, declared.name))
    if domain is None:
        return None
    return not (isinstance(inspected_type, DOMAIN) and inspected_type.name == domain
                and same_type(inspected_type.data_type, declared_type))


def same_type(inspected: TypeEngine[Any], declared: TypeEngine[Any]) -> bool:
    """Whether a reflected type (TEXT, SMALLINT, ARRAY of TEXT) is the declared one."""
    if isinstance(declared, ARRAY):
        return isinstance(inspected, ARRAY) and same_type(inspected.item_type, declared.item_type)
    return isinstance(inspected, type(declared))


def test_the_hot_tables_values_are_checked_by_their_domains(engine: Engine, schema: str) -> None:
    """Each rule on the values of ``message``, ``pending`` and ``op_record`` holds on its
    column's domain, and no CHECK constraint of theirs is left for a statement to read
    (revision 0016)."""
    with engine.connect() as conn:
        typed = set(conn.execute(text(
            "SELECT c.table_name, c.column_name, c.domain_name FROM information_schema.columns c "
            "WHERE c.table_schema = :schema AND c.domain_schema = :schema "
            "AND c.table_name IN ('message', 'pending', 'op_record')"
        ), {"schema": schema}).all())
        checks = conn.execute(text(
            "SELECT count(*) FROM pg_constraint "
            "WHERE contype = 'c' AND conrelid = ANY(CAST(:tables AS regclass[]))"),
            {"tables": [f"{schema}.{table}" for table in ("message", "pending", "op_record")]}
        ).scalar_one()
    assert typed == {(table, column, domain) for (table, column), domain in DOMAINS.items()}
    assert checks == 0
    for domain, good, bad in (("shard", "0", "64"), ("shard", "63", "-1"),
                              ("header_keys", "ARRAY['trace']", "ARRAY['a', 'outbox-id']"),
                              ("header_keys", "NULL", "ARRAY['content-type']"),
                              ("pending_status", "'PARKED'", "'DELIVERED'"),
                              ("pending_resolution", "'UNKNOWN'", "'ROLLBACK'"),
                              ("op_action", "'RESUMED'", "'SENT'")):
        with engine.connect() as conn:
            conn.execute(text(f"SELECT CAST({good} AS {schema}.{domain})"))
            with pytest.raises(DBAPIError, match=f'domain {schema}.{domain} violates check'):
                conn.execute(text(f"SELECT CAST({bad} AS {schema}.{domain})"))


def test_constraint_names_match_the_metadata(engine: Engine, schema: str) -> None:
    with engine.connect() as conn:
        in_database = set(conn.execute(text(
            "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace "
            "WHERE n.nspname = :schema AND conrelid::regclass::text NOT LIKE '%alembic%' "
            "AND NOT (SELECT relispartition FROM pg_class WHERE oid = c.conrelid)"
        ), {"schema": schema}).scalars())
    declared = {
        str(constraint.name) for table in target_metadata().sorted_tables
        for constraint in table.constraints
    }
    assert in_database == declared


def test_revision_creates_one_lease_per_shard(engine: Engine, schema: str) -> None:
    with engine.connect() as conn:
        shards = conn.execute(text(f"SELECT count(*) FROM {schema}.relay_lease")).scalar_one()
    assert shards == SHARDS


def test_the_cli_upgrade_makes_its_first_ranges_of_partition_size(
    services: devservices.Services, engine: Engine
) -> None:
    """docs/operations.md says `outbox db upgrade` makes the first ranges of history of
    `partition_size` ids; it made them of the default, a million, whatever the setting."""
    schema = f"m_{uuid.uuid4().hex[:10]}"
    env = {**__import__("os").environ, "OUTBOX_DATABASE_URL": services.database_url,
           "OUTBOX_SCHEMA": schema, "OUTBOX_PARTITION_SIZE": "5000"}
    try:
        up = run_outbox(None, "db", "upgrade", env=env)
        assert up.returncode == 0, up.stderr
        with engine.connect() as conn:
            sizes = {upper - lower for lower, upper in conn.execute(text(
                f"SELECT low, high FROM {schema}.partition_bounds('{schema}.message') "
                "WHERE low IS NOT NULL"))}  # the first range starts at MINVALUE
        assert sizes == {5000}
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def test_upgrade_downgrade_upgrade_through_the_cli(
    services: devservices.Services, engine: Engine
) -> None:
    schema = f"m_{uuid.uuid4().hex[:10]}"
    env = {**__import__("os").environ, "OUTBOX_DATABASE_URL": services.database_url,
           "OUTBOX_SCHEMA": schema}
    try:
        up = run_outbox(None, "db", "upgrade", env=env)
        assert up.returncode == 0, up.stderr
        assert f"schema {schema} is at revision {migrate.head()}" in up.stdout
        assert run_outbox(None, "db", "current", env=env).stdout.strip() == migrate.head()
        tables = set(inspect(engine).get_table_names(schema=schema)) - partitions(engine, schema)
        assert tables == {table.name for table in target_metadata().sorted_tables} | {VERSION_TABLE}
        assert "alembic_version" not in inspect(engine).get_table_names(schema="public")

        back = run_outbox(None, "db", "downgrade", "-1", env=env)  # Alembic's relative step
        assert back.returncode == 0, back.stderr
        previous = f"{int(migrate.head()) - 1:04d}"
        assert back.stdout.strip() == f"schema {schema} is at revision {previous}"

        down = run_outbox(None, "db", "downgrade", "base", env=env)
        assert down.returncode == 0, down.stderr
        assert down.stdout.strip() == f"schema {schema} is at revision base (no outbox tables)"
        assert set(inspect(engine).get_table_names(schema=schema)) == {VERSION_TABLE}
        assert run_outbox(None, "db", "current", env=env).stdout.strip() == "(none)"

        again = run_outbox(None, "db", "upgrade", env=env)
        assert again.returncode == 0, again.stderr
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def test_upgrade_from_0003_moves_unfinished_rows_in_place_and_they_keep_flowing(
    services: devservices.Services, engine: Engine, settings: Settings, topic: str
) -> None:
    """Rows written by the 0003 shape keep their state through 0004, and pending ones go out."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0003")
    try:
        old = {}
        with engine.begin() as conn:
            def row(status: str, resolution: str = "COMMIT", key: str | None = "k",
                    **extra: object) -> int:
                return int(conn.execute(text(
                    f"INSERT INTO {name}.message (topic, key, payload, content_type, shard, "
                    f"status, resolution, check_count, attempts, last_error, deliver_after) "
                    f"VALUES (:topic, :key, CAST(:payload AS bytea), 'text/plain', 5, :status, "
                    f":resolution, :checks, :attempts, :error, now() + CAST(:delay AS interval)) "
                    f"RETURNING id"),
                    {"topic": topic, "key": None if key is None else key.encode(),
                     "payload": f"{status}-{resolution}".encode(), "status": status,
                     "resolution": resolution, "checks": extra.get("checks", 0),
                     "attempts": extra.get("attempts", 0), "error": extra.get("error"),
                     "delay": extra.get("delay", "0 seconds")}).scalar_one())

            def op_record(message_id: int, action: str) -> None:
                conn.execute(text(f"INSERT INTO {name}.op_record (message_id, action, actor) "
                                  f"VALUES (:id, :action, 'relay')"),
                             {"id": message_id, "action": action})

            old["delivered"] = row("DELIVERED")
            op_record(old["delivered"], "DELIVERED")
            old["delivered_pruned_op"] = row("DELIVERED")
            old["rolled_back"] = row("ROLLED_BACK", "ROLLBACK")
            op_record(old["rolled_back"], "ROLLED_BACK")
            old["unknown"] = row("PENDING", "UNKNOWN", key="u", checks=3)
            old["parked"] = row("PARKED", key=None, attempts=5, error="too large")
            old["delayed"] = row("DELAYED", key="d", delay="1 hour")
            flowing = [row("PENDING", key=f"k{i % 3}") for i in range(6)]

        migrate.upgrade(services.database_url, name)

        with engine.connect() as conn:
            state = {r.id: r for r in conn.execute(text(
                f"SELECT id, status, resolution, check_count, attempts, last_error "
                f"FROM {name}.message_state"))}
            migrated_ops = conn.execute(text(
                f"SELECT message_id, action FROM {name}.op_record "
                f"WHERE actor = 'migration 0004'")).all()
        assert {k: (state[i].status, state[i].resolution) for k, i in old.items()} == {
            "delivered": ("DELIVERED", "COMMIT"),
            "delivered_pruned_op": ("DELIVERED", "COMMIT"),
            "rolled_back": ("ROLLED_BACK", "ROLLBACK"),
            "unknown": ("PENDING", "UNKNOWN"),
            "parked": ("PARKED", "COMMIT"),
            "delayed": ("DELAYED", "COMMIT"),
        }
        assert state[old["unknown"]].check_count == 3
        assert (state[old["parked"]].attempts, state[old["parked"]].last_error) == (5, "too large")
        assert migrated_ops == [(old["delivered_pruned_op"], "DELIVERED")]

        with running_relay(settings.model_copy(update={"schema_name": name})):
            wait_delivered(engine, name, 2 + len(flowing))
        assert_on_topic_in_key_order(services, topic, flowing)
    finally:
        drop_schema(engine, name)


def test_upgrade_from_0005_keeps_rows_in_place_and_they_keep_flowing_and_downgrade_back(
    services: devservices.Services, engine: Engine, settings: Settings, topic: str
) -> None:
    """0006 makes the old tables the first partitions: every state survives, pending rows
    go out in key order, new rows land in a new range; the downgrade keeps them all."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0005")
    try:
        old: dict[str, int] = {}
        with engine.begin() as conn:
            def row(born: str | None, resolution: str = "COMMIT", key: str | None = "k",
                    delay: str = "0 seconds", **later: object) -> int:
                written = conn.execute(text(
                    f"INSERT INTO {name}.message (topic, key, payload, content_type, shard, "
                    f"deliver_after) VALUES (:topic, :key, CAST(:payload AS bytea), "
                    f"'text/plain', 5, now() + CAST(:delay AS interval)) "
                    f"RETURNING id, created_at, deliver_after"),
                    {"topic": topic, "key": None if key is None else key.encode(),
                     "payload": f"{born}-{resolution}".encode(), "delay": delay}).one()
                if born is not None:
                    conn.execute(text(
                        f"INSERT INTO {name}.pending (message_id, shard, topic, key, "
                        f"producer_group, status, resolution, deliver_after, next_check_at, "
                        f"created_at) SELECT id, shard, topic, key, producer_group, "
                        f"CASE WHEN :delay = '0 seconds' THEN 'PENDING' ELSE 'DELAYED' END, "
                        f":resolution, deliver_after, now(), created_at "
                        f"FROM {name}.message WHERE id = :id"),
                        {"id": written.id, "resolution": resolution, "delay": delay})
                if later:
                    conn.execute(text(
                        f"UPDATE {name}.pending SET "
                        + ", ".join(f"{column} = :{column}" for column in later)
                        + " WHERE message_id = :id"), {"id": written.id, **later})
                return int(written.id)

            def op_record(message_id: int, action: str) -> None:
                conn.execute(text(f"INSERT INTO {name}.op_record (message_id, action, actor) "
                                  f"VALUES (:id, :action, 'relay')"),
                             {"id": message_id, "action": action})

            old["delivered"] = row(None)
            op_record(old["delivered"], "DELIVERED")
            old["rolled_back"] = row(None, "ROLLBACK")
            op_record(old["rolled_back"], "ROLLED_BACK")
            old["unknown"] = row("PENDING", "UNKNOWN", key="u", check_count=3)
            old["parked"] = row("PENDING", key=None, status="PARKED", attempts=5,
                                last_error="too large")
            op_record(old["parked"], "PARKED")
            old["discarded"] = row("PENDING", "UNKNOWN", key="x", status="DISCARDED",
                                   check_count=15)
            old["delayed"] = row("DELAYED", key="d", delay="1 hour")
            flowing = [row("PENDING", key=f"k{i % 3}") for i in range(6)]

        expected = {
            "delivered": ("DELIVERED", "COMMIT"), "rolled_back": ("ROLLED_BACK", "ROLLBACK"),
            "unknown": ("PENDING", "UNKNOWN"), "parked": ("PARKED", "COMMIT"),
            "discarded": ("DISCARDED", "UNKNOWN"), "delayed": ("DELAYED", "COMMIT"),
        }

        def states() -> dict[str, tuple[str, str]]:
            with engine.connect() as conn:
                found = {r.id: (r.status, r.resolution) for r in conn.execute(text(
                    f"SELECT id, status, resolution FROM {name}.message_state"))}
            return {k: found[i] for k, i in old.items()}

        def ops() -> set[tuple[int, str]]:
            with engine.connect() as conn:
                return {(r.message_id, r.action) for r in conn.execute(text(
                    f"SELECT message_id, action FROM {name}.op_record"))}

        ops_before = ops()
        migrate.upgrade(services.database_url, name)

        assert states() == expected
        assert ops() == ops_before
        with engine.connect() as conn:
            where = set(conn.execute(text(
                f"SELECT DISTINCT c.relname FROM {name}.message AS m "
                f"JOIN pg_class AS c ON c.oid = m.tableoid")).scalars())
        assert where == {"message_p0"}, "the old rows stay where they are"
        relay_settings = settings.model_copy(update={"schema_name": name})
        new = publish_orders(engine, Outbox(settings=relay_settings), topic, [("k0", 99)])
        assert new[0] > max(flowing)
        with running_relay(relay_settings):
            wait_until(lambda: states()["delivered"] == ("DELIVERED", "COMMIT") and ops() >= {
                (i, "DELIVERED") for i in [*flowing, *new]}, 60, "flowing rows delivered")
        assert_on_topic_in_key_order(services, topic, [*flowing, *new])

        migrate.downgrade(services.database_url, name, "0005")
        assert states() == expected
        assert ops() >= ops_before | {(i, "DELIVERED") for i in [*flowing, *new]}
        with engine.connect() as conn:
            kind = conn.execute(text(f"SELECT relkind FROM pg_class WHERE oid = "
                                     f"'{name}.message'::regclass")).scalar_one()
        assert kind == "r"
        migrate.upgrade(services.database_url, name)
    finally:
        drop_schema(engine, name)


def test_upgrade_to_0010_leaves_the_ranges_of_history_to_retention_and_downgrade_back(
    services: devservices.Services, engine: Engine
) -> None:
    """Ranges made before 0010 lose autovacuum as new ones are made without it; the default
    partitions keep it; the downgrade gives it back to them all."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0009")
    try:
        before = partition_options(engine, name)
        assert len(before) >= 4 and set(before.values()) == {None}, before
        migrate.upgrade(services.database_url, name)
        with engine.begin() as conn:
            store.ensure_partitions(conn, name, 1_000_000, ahead=4)
        after = partition_options(engine, name)
        assert set(after) > set(before), "a range made since"
        assert after == {part: None if part.endswith("_default") else
                         ["autovacuum_enabled=false"] for part in after}
        migrate.downgrade(services.database_url, name, "0009")
        assert set(partition_options(engine, name).values()) == {None}
    finally:
        drop_schema(engine, name)


def test_upgrade_to_0011_lets_a_relay_role_made_before_it_tend_ranges_and_downgrade_back(
    services: devservices.Services, engine: Engine
) -> None:
    """Relays already running as the relay role keep their retention passes, whose last
    step calls the function 0011 adds, without `outbox db roles` being run again."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0010")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {name}_relay NOLOGIN"))
    function = f"{name}.tend_range(text)"
    try:
        migrate.upgrade(services.database_url, name)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT has_function_privilege(:role, :f, 'EXECUTE')"),
                                {"role": f"{name}_relay", "f": function}).scalar_one()
            assert not conn.execute(text("SELECT has_function_privilege('public', :f, "
                                         "'EXECUTE')"), {"f": function}).scalar_one()
        migrate.downgrade(services.database_url, name, "0010")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT to_regprocedure(:f)"),
                                {"f": function}).scalar_one() is None
    finally:
        drop_schema(engine, name)
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {name}_relay"))


def test_upgrade_to_0012_tends_a_dropped_range_as_gone_and_downgrade_back(
    services: devservices.Services, engine: Engine
) -> None:
    """0012 replaces 0011's function in place: the relay role keeps its grant, a range
    dropped since it was listed answers ``gone``, and the downgrade raises for it again."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0011")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {name}_relay NOLOGIN"))
        conn.execute(text(f"GRANT EXECUTE ON FUNCTION {name}.tend_range(text) TO {name}_relay"))
    try:
        migrate.upgrade(services.database_url, name)
        with engine.begin() as conn:
            assert store.tend_range(conn, name, "message_p9999") == "gone"
            assert conn.execute(text("SELECT has_function_privilege(:role, :f, 'EXECUTE')"),
                                {"role": f"{name}_relay",
                                 "f": f"{name}.tend_range(text)"}).scalar_one()
        migrate.downgrade(services.database_url, name, "0011")
        with pytest.raises(DBAPIError, match="not a range"), engine.begin() as conn:
            store.tend_range(conn, name, "message_p9999")
    finally:
        drop_schema(engine, name)
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {name}_relay"))


def drained_queue(engine: Engine, schema: str) -> int:
    """Fill ``pending`` and delete every row, as a drain does; returns its size."""
    queue(engine, schema, "t", 5000)
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {schema}.pending"))
        return pending_size(conn, schema)


def pending_size(conn: Connection, schema: str) -> int:
    return int(conn.execute(text(f"SELECT pg_relation_size('{schema}.pending')")).scalar_one())


def vacuumed_size(engine: Engine, schema: str) -> int:
    """``pending``'s size after a VACUUM of it."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM {schema}.pending"))
        return pending_size(conn, schema)


def test_upgrade_to_0013_keeps_a_drained_queue_s_pages_and_downgrade_back(
    services: devservices.Services, engine: Engine
) -> None:
    """From 0013 VACUUM leaves a drained ``pending`` its pages (truncating them takes ACCESS
    EXCLUSIVE, which stops every publish); the downgrade lets it truncate them again."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name)
    try:
        size = drained_queue(engine, name)
        assert size > 0 and vacuumed_size(engine, name) == size
        migrate.downgrade(services.database_url, name, "0012")
        assert drained_queue(engine, name) > 0
        # Again until the deleted rows are dead to every snapshot (another session's
        # ANALYZE may still see them).
        wait_until(lambda: vacuumed_size(engine, name) == 0, 30, "VACUUM to truncate pending")
    finally:
        drop_schema(engine, name)


def app_may(conn: Connection, schema: str) -> tuple[bool, bool, bool]:
    """Whether the application role may call publish_message() and insert into ``message``
    and ``pending`` (a column privilege counts)."""
    role = f"{schema}_app"
    return tuple(conn.execute(text(  # type: ignore[return-value]
        "SELECT coalesce(has_function_privilege(:role, CAST(to_regproc(:f) AS oid), "
        "'EXECUTE'), false), "
        "has_any_column_privilege(:role, :message, 'INSERT'), "
        "has_any_column_privilege(:role, :pending, 'INSERT')"),
        {"role": role, "f": f"{schema}.publish_message", "message": f"{schema}.message",
         "pending": f"{schema}.pending"}).one())


def test_upgrade_to_0014_lets_an_app_role_made_before_it_publish_through_the_function(
    services: devservices.Services, engine: Engine
) -> None:
    """An application role made before 0014 may call publish_message() and keeps INSERT on the
    tables (its older statement, checked by the trigger, keeps working during the upgrade)
    until `--create-roles` refreshes the grants; the downgrade gives back what 0005 granted.
    PUBLIC may never call the function."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0013")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {name}_app NOLOGIN"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA {name} TO {name}_app"))
        conn.execute(text(f"GRANT INSERT ON {name}.message, {name}.pending TO {name}_app"))
    roles = [f"{name}_app"]
    try:
        migrate.upgrade(services.database_url, name)
        with engine.begin() as conn:
            assert app_may(conn, name) == (True, True, True)
            assert not conn.execute(text("SELECT has_function_privilege('public', CAST(:f AS "
                                         "regproc), 'EXECUTE')"),
                                    {"f": f"{name}.publish_message"}).scalar_one()
            conn.execute(text(f"SET LOCAL ROLE {name}_app"))
            assert Outbox(schema=name).publish(conn, "t", {"n": 1}) > 0
        roles = migrate.create_roles(services.database_url, name)
        with engine.begin() as conn:
            assert app_may(conn, name) == (True, False, False)
        migrate.downgrade(services.database_url, name, "0013")
        with engine.begin() as conn:
            assert app_may(conn, name) == (False, True, True)
    finally:
        drop_schema(engine, name)
        drop_roles(engine, roles)


def relay_reads(engine: Engine, schema: str) -> list[bool]:
    """Whether the relay's role may read each range of ``message``, lowest first."""
    with engine.connect() as conn:
        return [conn.execute(text("SELECT has_table_privilege(:role, :range, 'SELECT')"),
                             {"role": f"{schema}_relay", "range": f"{schema}.{name}"}
                             ).scalar_one() for name in ranges(engine, schema)]


def test_upgrade_to_0015_lets_a_relay_role_made_before_it_read_each_range(
    services: devservices.Services, engine: Engine
) -> None:
    """A relay role made before 0015 may read the ranges there were and those made after the
    upgrade; the downgrade takes those grants back, and ranges are made without them again."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0014")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {name}_relay NOLOGIN"))
    try:
        assert relay_reads(engine, name) == [False, False, False]
        migrate.upgrade(services.database_url, name)
        with engine.begin() as conn:
            assert store.ensure_partitions(conn, name, 1_000_000, ahead=3) == 1
        assert relay_reads(engine, name) == [True, True, True, True]
        migrate.downgrade(services.database_url, name, "0014")
        with engine.begin() as conn:
            assert store.ensure_partitions(conn, name, 1_000_000, ahead=4) == 1
        assert relay_reads(engine, name) == [False, False, False, False, False]
    finally:
        drop_schema(engine, name)
        drop_roles(engine, [f"{name}_relay"])


FILES = ("SELECT c.relname, c.relfilenode FROM pg_class AS c JOIN pg_namespace AS n "
         "ON n.oid = c.relnamespace WHERE n.nspname = :schema AND c.relkind IN ('r', 'i')")


def files(engine: Engine, schema: str) -> dict[str, int]:
    """The file of each table, partition and index of the schema, by name."""
    with engine.connect() as conn:
        return {name: node for name, node in conn.execute(text(FILES), {"schema": schema})}


def test_upgrade_to_0016_rewrites_no_table_and_rows_keep_flowing_and_downgrade_back(
    services: devservices.Services, engine: Engine, settings: Settings, topic: str
) -> None:
    """0016 types the publish's columns with domains: no table is written again (only the
    queue's partial indexes, which name status and resolution, are built again), the rows
    published before it are delivered after it in key order, and the downgrade keeps them."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0015")
    relay_settings = settings.model_copy(update={"schema_name": name})
    outbox = Outbox(settings=relay_settings)
    try:
        before = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(9)])
        held = files(engine, name)
        migrate.upgrade(services.database_url, name, "0016")
        after = files(engine, name)
        migrate.upgrade(services.database_url, name)
        assert after.keys() >= held.keys()  # (and the ranges made ahead since)
        assert {relation for relation in held if held[relation] != after[relation]} == {
            "pending_relay_idx", "pending_check_idx", "pending_hold_idx", "pending_delayed_idx"}
        with engine.begin() as conn, pytest.raises(DBAPIError, match="violates check constr"):
            conn.execute(text(f"UPDATE {name}.pending SET status = 'DELIVERED' "
                              f"WHERE message_id = :id"), {"id": before[0]})
        later = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(9, 12)])
        with running_relay(relay_settings):
            wait_delivered(engine, name, 12)
        assert_on_topic_in_key_order(services, topic, [*before, *later])
        migrate.downgrade(services.database_url, name, "0015")
        with engine.begin() as conn, pytest.raises(DBAPIError, match="pending_status_valid"):
            conn.execute(text(f"INSERT INTO {name}.pending (message_id, shard, topic, "
                              f"producer_group, status, resolution, created_at) "
                              f"VALUES (0, 0, 't', 'g', 'DELIVERED', 'COMMIT', now())"))
        assert count_status(engine, name, "DELIVERED") == 12
    finally:
        drop_schema(engine, name)


def op_record_indexes(engine: Engine, schema: str) -> set[tuple[str, str]]:
    """(table, the columns each index of op_record and its ranges is on)."""
    with engine.connect() as conn:
        return {(table, definition.split(" USING ")[1]) for table, definition in conn.execute(
            text("SELECT tablename, indexdef FROM pg_indexes "
                 "WHERE schemaname = :schema AND tablename LIKE 'op_record%'"),
            {"schema": schema})}


def test_upgrade_to_0017_keys_op_records_by_message_and_rows_keep_flowing_and_downgrade_back(
    services: devservices.Services, engine: Engine, settings: Settings, topic: str
) -> None:
    """0017 keys op_record by (message_id, id) in place of its key (id, message_id) and its
    index on message_id, over every range: op records written before it stay, the rows
    published before it are delivered after it in key order, and a message's op records
    are read through the key. The downgrade builds the old key and index again."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name)
    relay_settings = settings.model_copy(update={"schema_name": name})
    outbox = Outbox(settings=relay_settings)
    try:
        delivered = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(6)])
        with running_relay(relay_settings):
            wait_delivered(engine, name, 6)
        migrate.downgrade(services.database_url, name, "0016")
        tables = {table for table, _ in op_record_indexes(engine, name)}
        assert {"op_record", "op_record_default"} < tables  # and the ranges
        assert op_record_indexes(engine, name) == {
            (table, columns) for table in tables
            for columns in ("btree (id, message_id)", "btree (message_id)", "brin (created_at)")}
        waiting = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(6, 9)])
        migrate.upgrade(services.database_url, name)
        assert op_record_indexes(engine, name) == {
            (table, columns) for table in tables
            for columns in ("btree (message_id, id)", "brin (created_at)")}
        with running_relay(relay_settings):
            wait_delivered(engine, name, 9)
        assert_on_topic_in_key_order(services, topic, [*delivered, *waiting])
        with engine.connect() as conn:
            assert conn.execute(text(
                f"SELECT message_id, count(*) FROM {name}.op_record GROUP BY message_id "
                f"ORDER BY message_id")).all() == [(i, 1) for i in [*delivered, *waiting]]
            conn.execute(text("SET LOCAL enable_seqscan = off"))  # a few rows: as if many
            plan = "\n".join(conn.execute(text(
                f"EXPLAIN SELECT detail FROM {name}.op_record WHERE message_id = :id "
                f"ORDER BY id DESC LIMIT 1"), {"id": waiting[0]}).scalars())
        assert "Index Scan Backward using op_record_p" in plan and "_pkey" in plan, plan
        migrate.downgrade(services.database_url, name, "0016")
        assert op_record_indexes(engine, name) == {
            (table, columns) for table in tables
            for columns in ("btree (id, message_id)", "btree (message_id)", "brin (created_at)")}
        assert count_status(engine, name, "DELIVERED") == 9
    finally:
        drop_schema(engine, name)


def stored_before_0018(engine: Engine, schema: str, outbox: Outbox, topic: str, key: str,
                       header_keys: Any, header_values: Any, *, prepared: bool = False,
                       check_after: float | None = None) -> int:
    """A row as revision 0014's ``publish_message()`` stored whatever it was given."""
    message = dataclasses.replace(
        encode(topic, {"key": key}, key=key, headers=None, content_type=None,
               max_payload_bytes=1024, random_shard=0),
        header_keys=header_keys, header_values=header_values)
    statement, params = store.publish(schema, message, producer_group=outbox.producer_group,
                                      resolution=Resolution.UNKNOWN if prepared
                                      else Resolution.COMMIT, check_after_seconds=check_after)
    with engine.begin() as conn:
        return int(conn.execute(statement, params).scalar_one())


@both_transports
def test_rows_stored_before_0018_end_no_daemon_and_hold_no_key_after_0021(
    services: devservices.Services, engine: Engine, settings: Settings, topic: str
) -> None:
    """Before revision 0018, ``publish_message()`` stored header arrays that do not pair up
    and prepared rows without a check time. The relay parks the former, as records refused
    before sending (it ended at each fetch of one), the sweeper counts its checks of them
    inconclusive (it cannot hand them to a checker; it ended too), and revision 0021 gives
    the latter a check time (never checked, they held their keys back for good)."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0017")
    fast = settings.model_copy(update={
        "schema_name": name, "relay_max_attempts": 2, "check_max": 2, "check_interval": 0.1,
        "checker_timeout": 2.0, "sweep_poll_interval": 0.1})
    outbox = Outbox(settings=fast, producer_group="orders")
    try:
        unpaired = stored_before_0018(engine, name, outbox, topic, "a", ["x", "y"], [b"1"])
        two_dimensional = stored_before_0018(engine, name, outbox, topic, "d", [["x", "y"]],
                                             [[b"1", b"2"]])
        unchecked = stored_before_0018(engine, name, outbox, topic, "b", None, None,
                                       prepared=True)
        unreadable = stored_before_0018(engine, name, outbox, topic, "c", ["x"], [None],
                                        prepared=True, check_after=0)
        behind = publish_orders(engine, outbox, topic, [("a", 1), ("b", 2), ("d", 3)])
        migrate.upgrade(services.database_url, name)
        commit: dict[str, Checker] = {"orders": lambda message, conn: "COMMIT"}
        with running_relay(fast), running(Sweeper(fast, commit), "sweeper"):
            wait_delivered(engine, name, 4)
            wait_until(lambda: ids_with_status(engine, name, "PARKED") == [unpaired,
                                                                          two_dimensional]
                       and ids_with_status(engine, name, "DISCARDED") == [unreadable],
                       30, "the unpaired rows parked and discarded")
        records = read_topic(services.kafka_bootstrap, topic)
        assert [r.message_id for r in records if r.key == b"b"] == [unchecked, behind[1]]
        assert sorted(r.message_id for r in records) == sorted([unchecked, *behind])
        with engine.connect() as conn:
            details = {row.message_id: row.detail for row in conn.execute(text(
                f"SELECT message_id, detail FROM {name}.op_record "
                f"WHERE action IN ('PARKED', 'DISCARDED')"))}
        assert details[unpaired] == (
            f"UnsendableRecord: message {unpaired}: its 2 header names and 1 header values do "
            f"not pair up one to one, none of them NULL (a row stored before revision 0018)")
        assert "its 1 header names and 1 header values do not pair up" in details[
            two_dimensional]
        assert details[unreadable] == (
            "2 inconclusive check-backs, the last: not checked: its 1 header names and 1 "
            "header values do not pair up one to one, none of them NULL (a row stored before "
            "revision 0018)")
    finally:
        drop_schema(engine, name)


def test_publishing_to_a_schema_older_than_the_code_says_which_command_to_run(
    services: devservices.Services, engine: Engine
) -> None:
    """Code of 0014 against a schema of 0013: no publish_message() yet."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0013")
    try:
        with pytest.raises(SchemaNotMigrated, match="older than this version of outbox: run "
                           f"`outbox --schema {name} db upgrade`"), engine.begin() as conn:
            Outbox(schema=name).publish(conn, "t", {"n": 1})
    finally:
        drop_schema(engine, name)


def test_a_schema_newer_than_the_code_says_so_and_not_to_upgrade(
    engine: Engine, settings: Settings
) -> None:
    """A rolling upgrade: the new release migrated, an old relay restarts. It said "run
    `outbox db upgrade` first", and `outbox db upgrade` then failed with Alembic's "Can't
    locate revision identified by '9999'"."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(settings.database_url, name)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE {name}.outbox_alembic_version SET version_num = '9999'"))
        newer = settings.model_copy(update={"schema_name": name})
        for command in (["relay"], ["status"], ["db", "upgrade"]):
            ran = run_outbox(newer, *command)
            assert (ran.returncode, ran.stderr.strip()) == (2, (
                f"outbox: error: outbox schema {name!r} is at revision 9999, newer than this "
                f"outbox (its newest is {migrate.head()}): run the outbox version that upgraded "
                "it, or downgrade the schema with that version first")), command
    finally:
        drop_schema(engine, name)


def test_an_upgrade_waiting_for_a_lock_does_not_queue_the_outbox_s_readers_behind_it(
    services: devservices.Services, engine: Engine, caplog: pytest.LogCaptureFixture,
) -> None:
    """A long transaction reads op_record while `db upgrade` needs it exclusively (0017):
    every reader and writer of op_record (the relay's recorder, `outbox status`, a publisher
    reading the key's history) would queue behind the waiting ALTER until that transaction
    ends. The upgrade gives up its wait within seconds, names who holds the lock, and tries
    again; it completes once the lock is free."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0016")
    try:
        with engine.connect() as holder:
            holder.execute(text(f"SELECT count(*) FROM {name}.op_record"))  # stays open
            upgrading = threading.Thread(
                target=migrate.upgrade, args=(services.database_url, name), daemon=True)
            upgrading.start()
            wait_until(lambda: waiting_for_a_lock(engine), 10, "the upgrade to wait")
            started = time.monotonic()
            with engine.connect() as reader:
                reader.execute(text("SET statement_timeout = '8s'"))
                reader.execute(text(f"SELECT count(*) FROM {name}.op_record"))
            assert time.monotonic() - started < 6
            wait_until(lambda: "a lock it needs" in caplog.text, 10, "the retry to be logged")
            assert upgrading.is_alive()
            holder.rollback()
        upgrading.join(30)
        assert not upgrading.is_alive()
        assert migrate.current(services.database_url, name) == migrate.head()
        waits = [r.getMessage() for r in caplog.records if "a lock it needs" in r.getMessage()]
        assert f"SELECT count(*) FROM {name}.op_record" in waits[0], waits
    finally:
        drop_schema(engine, name)


def test_a_message_an_older_application_commits_while_0004_upgrades_is_kept(
    services: devservices.Services, engine: Engine
) -> None:
    """0004 copied the unfinished rows into ``pending`` before it locked ``message``: a
    publish of the older application (upgrade first, restart after) committed while the op
    records were backfilled had no pending row once the old columns were dropped, and was
    never delivered nor checked. The backfill is made to wait here, as a long one does."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0003")
    upgrading = threading.Thread(
        target=migrate.upgrade, args=(services.database_url, name), daemon=True)
    try:
        with engine.connect() as publisher, engine.connect() as holder:
            published = publisher.execute(text(
                f"INSERT INTO {name}.message (topic, key, payload, content_type, shard, status, "
                f"resolution) VALUES ('t', NULL, '\\x7b7d'::bytea, 'application/json', 3, "
                f"'PENDING', 'COMMIT') RETURNING id")).scalar_one()
            holder.execute(text(f"LOCK TABLE {name}.op_record IN SHARE MODE"))
            upgrading.start()
            wait_until(lambda: statement_waits(engine, name), 10, "the upgrade to wait")
            publisher.commit()
            holder.rollback()
        upgrading.join(60)
        assert not upgrading.is_alive()
        assert migrate.current(services.database_url, name) == migrate.head()
        with engine.connect() as conn:
            state = conn.execute(text(
                f"SELECT status, resolution FROM {name}.message_state WHERE id = :id"),
                {"id": published}).one()
        assert tuple(state) == ("PENDING", "COMMIT")
    finally:
        upgrading.join(60)
        drop_schema(engine, name)


def test_a_message_committed_while_a_downgrade_copies_the_history_is_kept(
    services: devservices.Services, engine: Engine
) -> None:
    """0006's downgrade copied ``message`` into a plain table before it locked it: a publish
    committed during the copy was dropped with the partitioned table."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0013")
    downgrading = threading.Thread(
        target=migrate.downgrade, args=(services.database_url, name, "0005"), daemon=True)
    try:
        with engine.connect() as publisher:
            published = publisher.execute(text(
                f"INSERT INTO {name}.message (producer_group, topic, payload, content_type, "
                f"shard) VALUES ('g', 't', '\\x7b7d'::bytea, 'application/json', 3) "
                f"RETURNING id")).scalar_one()
            downgrading.start()
            wait_until(lambda: statement_waits(engine, name), 10, "the downgrade to wait")
            publisher.commit()
        downgrading.join(60)
        assert not downgrading.is_alive()
        assert migrate.current(services.database_url, name) == "0005"
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT id FROM {name}.message")).scalars().all() \
                == [published]
    finally:
        downgrading.join(60)
        drop_schema(engine, name)


def statement_waits(engine: Engine, schema: str) -> bool:
    """Whether a statement naming ``schema`` waits for a lock."""
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :named"), {"named": f"%{schema}.%"}).scalar_one())


def waiting_for_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE 'ALTER TABLE%'")).scalar_one())


def test_an_upgrade_as_a_role_with_a_statement_timeout_copies_every_row(
    services: devservices.Services, engine: Engine
) -> None:
    """`db upgrade` ran with the role's ``statement_timeout``: 0004's copy of a large 0003
    table was cancelled, and the upgrade failed however often it was run. Its lock waits
    are bounded by the upgrade itself."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    login = f"{name}_dba"
    migrate.upgrade(services.database_url, name, "0003")
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {name}.message (topic, key, payload, content_type, shard, status, "
            f"resolution) SELECT 't', NULL, '\\x7b7d'::bytea, 'application/json', g % 64, "
            f"'DELIVERED', 'COMMIT' FROM generate_series(1, 50000) AS g"))
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' IN ROLE "
                          f"{devservices.DB_USER}"))
        # far above a SET's time on a loaded machine, far below a copy of 50,000 rows
        conn.execute(text(f"ALTER ROLE {login} SET statement_timeout = '50ms'"))
    url = services.database_url.replace(
        f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
    try:
        migrate.upgrade(url, name)
        assert migrate.current(services.database_url, name) == migrate.head()
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT count(*) FROM {name}.message")).scalar_one() \
                == 50_000
    finally:
        drop_schema(engine, name)
        with engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {login}"))
            conn.execute(text(f"DROP ROLE {login}"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_an_upgrade_stopped_by_a_signal_mid_migration_rolls_back_whole_and_says_so(
    services: devservices.Services, engine: Engine, signum: signal.Signals
) -> None:
    """SIGTERM killed `db upgrade` without a word (exit 143), its statement left queued for
    the lock it waited for; Ctrl-C said 'Aborted!' and exit code 1. It now cancels the
    statement, rolls the migration back and says where the schema is."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    migrate.upgrade(services.database_url, name, "0003")
    env = {**os.environ, "OUTBOX_DATABASE_URL": services.database_url, "OUTBOX_SCHEMA": name}
    try:
        with engine.connect() as holder:
            holder.execute(text(f"LOCK TABLE {name}.op_record IN SHARE MODE"))
            upgrading = subprocess.Popen([sys.executable, "-m", "outbox", "db", "upgrade"],
                                         env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
            wait_until(lambda: statement_waits(engine, name), 10, "the upgrade to wait")
            upgrading.send_signal(signum)
            stdout, stderr = upgrading.communicate(timeout=20)
            assert not statement_waits(engine, name), "its statement still queued"
        assert (upgrading.returncode, stdout, stderr) == (128 + signum, "", (
            f"outbox: error: db upgrade was stopped ({signum.name}): a migration not yet "
            f"committed was rolled back, whole (`outbox db current` prints the revision "
            f"schema {name} is at)\n"))
        assert migrate.current(services.database_url, name) == "0003"
    finally:
        drop_schema(engine, name)
