"""The relay's role may read each range of ``message`` directly.

The relay reads a batch's messages by id. Through the parent ``message``, PostgreSQL plans
the lookup for every batch: planned once, a plan of a partitioned table locks every
partition of retained history each time it runs. Read from the one range that holds the
batch's ids, the lookup is planned once and locks that range alone (``store.fetch_deliverable``);
the relay's p50 commit → ack at 1,000 msg/s was 1.3 ms lower (BENCHMARKS.md, "Latency,
session 23").

Reading a partition directly needs SELECT on it, not only on the parent:

* ``ensure_partitions`` grants SELECT on each new range of ``message`` to ``{schema}_relay``
  when that role exists (the ranges of ``op_record`` stay out of its reach);
* ``grant_ranges()`` (SECURITY DEFINER, for no one but its owner) grants it on every range
  there is now: this upgrade calls it, and so does ``outbox db upgrade --create-roles``, which
  starts by taking every grant back.

A relay without the grant reads through the parent, as before. The downgrade takes the
grants back (``revoke_ranges``).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

ATTACHED = """'FOR VALUES FROM (%s) TO (%s)', 'message_p' || low, low, low + size);
"""
GRANTED = """        IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_relay') THEN
            EXECUTE format('GRANT SELECT ON {schema}.%I TO %I', 'message_p' || low,
                           '{schema}_relay');
        END IF;
"""


def partition_functions(schema: str, *, granted: bool) -> str:
    """Revision 0010's functions; with ``granted``, ``ensure_partitions`` grants the relay's
    role SELECT on each range of ``message`` it makes."""
    path = Path(__file__).with_name("0010_history_partitions_skip_autovacuum.py")
    revision_0010 = load_module_py("outbox_revision_0010", path)
    functions: str = revision_0010.partition_functions(schema, unvacuumed=True)
    assert functions.count(ATTACHED) == 1, "revision 0006 attaches message ranges once"
    if not granted:
        return functions
    return functions.replace(ATTACHED, ATTACHED + GRANTED.replace("{schema}", schema))


def grant_ranges(schema: str) -> str:
    return f"""
CREATE FUNCTION {schema}.grant_ranges() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
    range_name text;
    granted integer := 0;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_relay') THEN
        RETURN 0;
    END IF;
    FOR range_name IN SELECT b.name FROM {schema}.partition_bounds('{schema}.message') AS b
    LOOP
        EXECUTE format('GRANT SELECT ON {schema}.%I TO %I', range_name, '{schema}_relay');
        granted := granted + 1;
    END LOOP;
    RETURN granted;
END
$body$;

REVOKE ALL ON FUNCTION {schema}.grant_ranges() FROM PUBLIC;"""


def revoke_ranges(schema: str) -> str:
    """Takes back from ``{schema}_relay`` the SELECT on each range of ``message``."""
    return f"""
DO $body$
DECLARE
    range_name text;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_relay') THEN
        RETURN;
    END IF;
    FOR range_name IN SELECT b.name FROM {schema}.partition_bounds('{schema}.message') AS b
    LOOP
        EXECUTE format('REVOKE SELECT ON {schema}.%I FROM %I', range_name, '{schema}_relay');
    END LOOP;
END
$body$;"""


def upgrade() -> None:
    schema = target_schema()
    op.execute(partition_functions(schema, granted=True))
    op.execute(grant_ranges(schema))
    op.execute(f"SELECT {schema}.grant_ranges()")


def downgrade() -> None:
    schema = target_schema()
    op.execute(f"DROP FUNCTION {schema}.grant_ranges()")
    op.execute(partition_functions(schema, granted=False))
    op.execute(revoke_ranges(schema))
