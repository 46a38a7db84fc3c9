"""Rows with keys of any length hold back their key: ``pending_hold_idx`` indexes a key by
its first 2,048 bytes.

The index of the rows that hold back their key's later rows (delayed, undecided, or flagged
``held``: revision 0024) held the key itself, and PostgreSQL caps a B-tree entry at 2,704
bytes. The library refused a prepared or delayed message's key over 2,048 bytes for it, but
a plain message takes a key up to its size limit, and once its topic was held the relay's
flagging failed at every step ("index row size 3040 exceeds btree version 4 maximum 2704
for index pending_hold_idx"): the relay paused, and every topic of its shards with it. Now
the index holds a key's first 2,048 bytes (all of nearly every key, so it reads as before;
a long key is sliced from its TOAST chunks, not read whole); the key-hold test (queries.sql,
``held_back``) compares the same prefix, then the keys themselves.

The index is built again, which holds writes to ``pending`` while it builds (it lists only
the waiting rows). The downgrade builds the old one, which fails, and rolls back whole, if a
row that waits has a key over 2,704 bytes.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

WAITING = ("key IS NOT NULL AND (status = 'DELAYED' OR (status = 'PENDING' AND resolution = "
           "'UNKNOWN') OR held)")
HOLD_KEY = "substr(key, 1, 2048)"


def upgrade() -> None:
    schema = target_schema()
    op.drop_index("pending_hold_idx", "pending", schema=schema)
    op.create_index("pending_hold_idx", "pending", ["topic", sa.text(HOLD_KEY), "message_id"],
                    schema=schema, postgresql_where=sa.text(WAITING))


def downgrade() -> None:
    schema = target_schema()
    op.drop_index("pending_hold_idx", "pending", schema=schema)
    op.create_index("pending_hold_idx", "pending", ["topic", "key", "message_id"],
                    schema=schema, postgresql_where=sa.text(WAITING))
