"""Alembic revisions match the Core metadata, reverse cleanly and keep to their own table.

These tests run Alembic online (``schema`` is overridden below): they prove the migrations
themselves, and that the copy every other test gets (tests/conftest.py) is the same schema.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, MetaData, inspect, text

from outbox import migrate
from outbox.dev import services as devservices
from outbox.migrations import target_metadata
from outbox.schema import SHARDS, VERSION_TABLE
from tests.conftest import fresh_schema
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
}


def catalog(engine: Engine, schema: str) -> dict[str, set[tuple[object, ...]]]:
    """Columns, constraints, indexes and rows of a schema, with its name left out."""
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


def test_migrated_schema_matches_the_metadata(engine: Engine, schema: str) -> None:
    in_schema = MetaData()
    for table in target_metadata().sorted_tables:
        table.to_metadata(in_schema, schema=schema)
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={"include_schemas": True,
                  "include_name": lambda name, kind, _: kind != "schema" or name == schema},
        )
        diff = [d for d in compare_metadata(context, in_schema)
                if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []


def test_constraint_names_match_the_metadata(engine: Engine, schema: str) -> None:
    with engine.connect() as conn:
        in_database = set(conn.execute(text(
            "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace "
            "WHERE n.nspname = :schema AND conrelid::regclass::text NOT LIKE '%alembic%'"
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
        tables = set(inspect(engine).get_table_names(schema=schema))
        assert tables == {table.name for table in target_metadata().sorted_tables} | {VERSION_TABLE}
        assert "alembic_version" not in inspect(engine).get_table_names(schema="public")

        down = run_outbox(None, "db", "downgrade", "base", env=env)
        assert down.returncode == 0, down.stderr
        assert set(inspect(engine).get_table_names(schema=schema)) == {VERSION_TABLE}
        assert run_outbox(None, "db", "current", env=env).stdout.strip() == "(none)"

        again = run_outbox(None, "db", "upgrade", env=env)
        assert again.returncode == 0, again.stderr
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
