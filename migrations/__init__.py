"""Alembic environment and revisions for the outbox tables (see outbox/migrate.py)."""

from alembic import op


def target_schema() -> str:
    """The schema being migrated: our version table lives in it, so its name is the one."""
    schema: str | None = op.get_context().version_table_schema
    assert schema, "the outbox's env.py always sets version_table_schema"
    return schema
