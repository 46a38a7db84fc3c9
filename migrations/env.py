"""Alembic environment: migrates the outbox tables into one schema with its own version table.

Run through ``outbox db upgrade`` (outbox/migrate.py), which passes the schema and database
in ``config.attributes``; an application's own Alembic never sees our version table.
"""

from alembic import context
from sqlalchemy import Connection, create_engine, text

from outbox.migrations import target_metadata
from outbox.schema import VERSION_TABLE, translate
from outbox.settings import validate_identifier

config = context.config
schema = validate_identifier(config.attributes.get("schema", "outbox"))


def run(connection: Connection) -> None:
    connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
    context.configure(
        connection=connection.execution_options(schema_translate_map=translate(schema)),
        target_metadata=target_metadata(),
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_schemas=True,
        include_name=lambda name, type_, _: type_ != "schema" or name == schema,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(
        url=config.attributes["url"],
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
elif "connection" in config.attributes:
    run(config.attributes["connection"])
else:
    engine = create_engine(config.attributes["url"])
    with engine.begin() as conn:
        run(conn)
    engine.dispose()
