"""Alembic environment and revisions for the outbox tables (see outbox/migrate.py)."""

from alembic import op
from sqlalchemy import MetaData


def target_metadata() -> MetaData:
    """Every table the migrations manage: the library's and the reconcile job's own."""
    from outbox.schema import metadata
    from outbox.spark import runs  # noqa: F401  (declares reconcile_run on the metadata)

    return metadata


def target_schema() -> str:
    """The schema being migrated: our version table lives in it, so its name is the one."""
    schema: str | None = op.get_context().version_table_schema
    assert schema, "the outbox's env.py always sets version_table_schema"
    return schema
