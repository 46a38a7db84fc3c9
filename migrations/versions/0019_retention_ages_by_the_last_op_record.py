"""Retention ages history by its last op record too, not by the message's publish alone.

A message published long ago can finish now: delayed past the window (``max_delay`` is 30
days, ``retention_hours`` 72 h by default), decided late, or resumed after parking. Its op
records are young, its message row old. ``drop_expired_partition`` asked only whether a
range's messages were past the window, and ``prune_default`` (where such a message has moved
once its range went) only whether the message was: the fresh op records went with the
message, within a ``prune_interval`` of the delivery, before the next reconciliation saw
them. With ``--read-topics`` its record in Kafka then read as one without an op record
(``kafka_record_without_op_record``), a failed run.

Now a range is kept while its range of ``op_record`` holds a record inside the window (the
same BRIN index on ``created_at`` answers it), and a message of the default partition while
it has an op record inside the window (by the op records' key, ``(message_id, id)``).

The downgrade puts revision 0015's functions back.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

RANGE_YOUNG = """\
        EXECUTE format('SELECT EXISTS (SELECT FROM {schema}.%I WHERE created_at >= '
                       'now() - make_interval(secs => $1))', candidate.name)
            INTO young USING retention_seconds;
"""
RANGE_OR_OPS_YOUNG = """\
        EXECUTE format('SELECT EXISTS (SELECT FROM {schema}.%I WHERE created_at >= '
                       'now() - make_interval(secs => $1)) OR EXISTS (SELECT FROM '
                       '{schema}.%I WHERE created_at >= now() - make_interval(secs => $1))',
                       candidate.name, 'op_record_' || substring(candidate.name FROM 9))
            INTO young USING retention_seconds;
"""
UNFINISHED = """\
              AND NOT EXISTS (SELECT FROM {schema}.pending AS p WHERE p.message_id = m.id)
"""
NOR_FINISHED_LATE = UNFINISHED + """\
              AND NOT EXISTS (
                  SELECT FROM {schema}.op_record_default AS o
                  WHERE o.message_id = m.id
                    AND o.created_at >= now() - make_interval(secs => retention_seconds))
"""


def partition_functions(schema: str, *, by_last_op: bool) -> str:
    """Revision 0015's functions; with ``by_last_op``, retention keeps history whose op
    records are inside the window."""
    path = Path(__file__).with_name("0015_the_relay_reads_ranges_of_history.py")
    revision_0015 = load_module_py("outbox_revision_0015", path)
    functions: str = revision_0015.partition_functions(schema, granted=True)
    young, unfinished = (text.replace("{schema}", schema) for text in (RANGE_YOUNG, UNFINISHED))
    assert functions.count(young) == 1, "revision 0006's drop asks once whether a range is young"
    assert functions.count(unfinished) == 1, "revision 0006's prune skips unfinished messages"
    if not by_last_op:
        return functions
    return functions.replace(young, RANGE_OR_OPS_YOUNG.replace("{schema}", schema)).replace(
        unfinished, NOR_FINISHED_LATE.replace("{schema}", schema))


def upgrade() -> None:
    op.execute(partition_functions(target_schema(), by_last_op=True))


def downgrade() -> None:
    op.execute(partition_functions(target_schema(), by_last_op=False))
