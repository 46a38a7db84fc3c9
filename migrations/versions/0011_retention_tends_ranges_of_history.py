"""Retention analyzes ranges of history and summarizes their BRIN indexes as they fill.

Revision 0010 took ranges of ``message`` and ``op_record`` away from autovacuum, and with it
the two things autovacuum did that readers need:
- **statistics**: a range never analyzed has none, and the planner scans it whole for any
  condition on ``created_at``;
- **BRIN summaries**: a block range never summarized is read row by row.
Every read of a window of history went through every range it kept: the relay's takeover
(``recorded_offsets``), ``outbox status``, the console's delivery history, Spark's
reconciliation. With 700,000 op records in four ranges, a takeover's look at an empty window
read all 700,000; with both, none.

``tend_range(name)`` gives one range both, as the owner: it summarizes the BRIN block ranges
written since the last call (the partial last one too) and, when the range has never been
analyzed or has changed by a tenth since, analyzes it (autovacuum's own rule, without its
VACUUM, on a tenth of the sample). Each retention pass calls it for every range, one short
transaction each; a range no one wrote to since is left alone, and a range locked by someone
else (a VACUUM against wraparound) is skipped until the next pass.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from alembic import op

from outbox.migrations import target_schema

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: Changes since the last ANALYZE, as a share of the rows then, that call for another one.
ANALYZE_SCALE = 0.1
#: A sample of 3,000 rows (PostgreSQL's default, 100, samples 30,000): ranges are written in
#: ``created_at`` order, which a small sample shows as well as a large one. ANALYZE of a
#: range of 670 MB took 17-21 ms instead of 244-411 ms.
STATISTICS_TARGET = 10


def tend_range(schema: str) -> str:
    return f"""
CREATE FUNCTION {schema}.tend_range(range_name text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET lock_timeout = '500ms' SET default_statistics_target = {STATISTICS_TARGET} AS $body$
DECLARE
    part regclass;
    rows_then real;
    changed bigint;
BEGIN
    SELECT c.oid::regclass, c.reltuples INTO part, rows_then
    FROM pg_inherits AS h JOIN pg_class AS c ON c.oid = h.inhrelid
    WHERE h.inhparent IN ('{schema}.message'::regclass, '{schema}.op_record'::regclass)
      AND c.relname = range_name AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT';
    IF part IS NULL THEN
        RAISE EXCEPTION 'not a range of {schema}''s history: %', range_name
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    changed := coalesce(pg_stat_get_mod_since_analyze(part), 0);
    IF pg_relation_size(part) = 0 OR (rows_then >= 0 AND changed = 0) THEN
        RETURN 'untouched';  -- never written, or nothing new since it was tended
    END IF;
    PERFORM brin_summarize_new_values(i.indexrelid)
    FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
    JOIN pg_am AS a ON a.oid = c.relam
    WHERE i.indrelid = part AND a.amname = 'brin';
    IF rows_then < 0 OR changed > {ANALYZE_SCALE} * rows_then THEN
        EXECUTE format('ANALYZE %s', part);
        RETURN 'analyzed';
    END IF;
    RETURN 'summarized';
EXCEPTION WHEN lock_not_available THEN
    RETURN 'busy';
END
$body$;
REVOKE ALL ON FUNCTION {schema}.tend_range(text) FROM PUBLIC;
-- Relays already running as the relay role keep their retention passes (`outbox db roles`
-- grants it too).
DO $grant$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_relay') THEN
        GRANT EXECUTE ON FUNCTION {schema}.tend_range(text) TO {schema}_relay;
    END IF;
END
$grant$;"""


def upgrade() -> None:
    op.execute(tend_range(target_schema()))


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {target_schema()}.tend_range(text)")
