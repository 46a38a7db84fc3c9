"""A held topic's waiting rows leave the relay's fetch: a ``held`` flag on ``pending``.

The fetch walks ``pending_relay_idx`` in id order and skipped a held topic's rows by their
topic, so every fetch walked again every held row older than the other topics' (1,000,000
held rows made a fetch of 500 rows of another topic take 102.7 ms instead of 3.6 ms,
BENCHMARKS.md). Now the relay flags a held topic's rows as it notes their reason
(relay/holds.py), and a flagged row is out of ``pending_relay_idx``: the walk never meets
it. A flagged keyed row holds back the later rows of its key, as a delayed one does
(``pending_hold_idx``), and ``pending_held_idx`` finds a topic's flagged rows, per shard, for
the relay that releases, tries or heals them.

Adding the column rewrites nothing (a constant default); the three indexes are built again,
which locks ``pending`` against writes while they build (the table holds only unfinished
messages). Rows in place start unflagged: a relay of this revision notes its holds again. The
relay role may write the flag (granted here if the role exists; ``--create-roles`` grants it
too).

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

DELIVERABLE = "status = 'PENDING' AND resolution = 'COMMIT'"
HOLDS = ("key IS NOT NULL AND (status = 'DELAYED' OR (status = 'PENDING' AND resolution = "
         "'UNKNOWN'){})")


def _indexes(schema: str, *, flag: bool) -> None:
    op.create_index("pending_relay_idx", "pending", ["message_id"], schema=schema,
                    postgresql_where=sa.text(DELIVERABLE + (" AND NOT held" if flag else "")))
    op.create_index("pending_hold_idx", "pending", ["topic", "key", "message_id"],
                    schema=schema,
                    postgresql_where=sa.text(HOLDS.format(" OR held" if flag else "")))


def upgrade() -> None:
    schema = target_schema()
    op.add_column("pending", sa.Column("held", sa.Boolean, nullable=False,
                                       server_default=sa.false()), schema=schema)
    op.drop_index("pending_relay_idx", "pending", schema=schema)
    op.drop_index("pending_hold_idx", "pending", schema=schema)
    _indexes(schema, flag=True)
    op.create_index("pending_held_idx", "pending", ["topic", "shard", "message_id"],
                    schema=schema, postgresql_where=sa.text("held"))
    op.execute(f"""
DO $grant$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_relay') THEN
        GRANT UPDATE (held) ON {schema}.pending TO {schema}_relay;
    END IF;
END
$grant$""")


def downgrade() -> None:
    schema = target_schema()
    for index in ("pending_held_idx", "pending_hold_idx", "pending_relay_idx"):
        op.drop_index(index, "pending", schema=schema)
    op.drop_column("pending", "held", schema=schema)
    _indexes(schema, flag=False)
