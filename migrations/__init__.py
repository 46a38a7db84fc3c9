"""Alembic environment and revisions for the outbox tables (see outbox/migrate.py)."""

from sqlalchemy import MetaData


def target_metadata() -> MetaData:
    """Every table the migrations manage: the library's and the reconcile job's own."""
    from outbox.schema import metadata
    from outbox.spark import runs  # noqa: F401  (declares reconcile_run on the metadata)

    return metadata


def target_schema() -> str:
    """The schema being migrated: our version table lives in it, so its name is the one."""
    from alembic import op  # only while migrating: outbox.migrate says why

    schema: str | None = op.get_context().version_table_schema
    if not schema:
        raise RuntimeError(
            "the outbox's revisions run only through outbox.migrate: remove them from your "
            "version_locations and call outbox.migrate.upgrade() from your env.py, or run "
            "`outbox db upgrade`"
        )
    return schema
