"""Autovacuum leaves the ranges of history alone; retention summarizes what it reads.

A range partition of ``message`` or ``op_record`` is written once, never updated, and dropped
whole by retention, yet autovacuum visited each one as its inserts piled up (PostgreSQL's
insert-triggered VACUUM ANALYZE: every page read and dirtied again, throttled, 15-20 s for a
range of 230 MB). At 18,000 msg/s (`bench/soak.py --retention-only`) its workers were busy on
such ranges in 74% of the samples; at 23,000 one of them was at work on the very range retention
wanted to drop (a drop takes its range without waiting, so that pass dropped nothing), and
partitions piled up from 16 to 27. Ranges now have ``autovacuum_enabled = false``: no
VACUUM, no ANALYZE (their lookups are by primary key), and still the VACUUM PostgreSQL forces
against transaction-id wraparound. The default partitions keep autovacuum: retention deletes
from them.

VACUUM was also what summarized a range's BRIN index on ``created_at``, which the drop reads
to learn whether a range still holds messages inside the window; an unsummarized block range
is read row by row. The drop now summarizes the candidate's new block ranges itself
(``brin_summarize_new_values``, as the owner): a range is full by then, so that is one read
of it, once.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TABLES = ("message", "op_record")
CHECK = "        -- The BRIN index answers this from block ranges, not rows.\n"
SUMMARIZE = """\
        -- Summarized here, not by autovacuum (revision 0010); a full range, so once.
        PERFORM brin_summarize_new_values(i.indexrelid)
        FROM pg_catalog.pg_index AS i
        JOIN pg_catalog.pg_inherits AS h ON h.inhrelid = i.indexrelid
        WHERE h.inhparent = '{schema}.message_created_at_idx'::regclass
          AND i.indrelid = format('{schema}.%I', candidate.name)::regclass;
"""


def create_range(schema: str, table: str) -> str:
    return (f"'CREATE TABLE {schema}.%I (LIKE {schema}.{table} INCLUDING DEFAULTS '\n"
            f"                       'INCLUDING CONSTRAINTS)'")


def partition_functions(schema: str, *, unvacuumed: bool) -> str:
    """Revision 0009's functions; with ``unvacuumed``, new ranges are made without
    autovacuum and the drop summarizes a candidate's BRIN index before reading it."""
    path = Path(__file__).with_name("0009_retention_queues_for_its_locks.py")
    revision_0009 = load_module_py("outbox_revision_0009", path)
    functions: str = revision_0009.partition_functions(schema, queue=True)
    assert functions.count(CHECK) == 1, "revision 0006's drop reads the BRIN index"
    for table in TABLES:
        assert functions.count(create_range(schema, table)) == 1, f"0006 makes {table} ranges"
    if not unvacuumed:
        return functions
    for table in TABLES:
        made = create_range(schema, table)
        functions = functions.replace(
            made, made[:-1] + " WITH (autovacuum_enabled = false)'")
    return functions.replace(CHECK, SUMMARIZE.replace("{schema}", schema) + CHECK)


def set_ranges(schema: str, option: str) -> str:
    """``option`` on every range partition there is now (not the default partitions)."""
    return f"""
DO $ranges$
DECLARE
    part regclass;
BEGIN
    FOR part IN
        SELECT c.oid::regclass FROM pg_catalog.pg_inherits AS h
        JOIN pg_catalog.pg_class AS c ON c.oid = h.inhrelid
        WHERE h.inhparent IN ('{schema}.message'::regclass, '{schema}.op_record'::regclass)
          AND NOT pg_catalog.pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT'
    LOOP
        EXECUTE format('ALTER TABLE %s {option}', part);
    END LOOP;
END
$ranges$"""


def upgrade() -> None:
    schema = target_schema()
    op.execute(partition_functions(schema, unvacuumed=True))
    op.execute(set_ranges(schema, "SET (autovacuum_enabled = false)"))


def downgrade() -> None:
    schema = target_schema()
    op.execute(set_ranges(schema, "RESET (autovacuum_enabled)"))
    op.execute(partition_functions(schema, unvacuumed=False))
