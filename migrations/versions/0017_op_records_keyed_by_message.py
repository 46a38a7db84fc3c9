"""``op_record``'s primary key leads with ``message_id``: one index fewer to write per delivery.

Every read of ``op_record`` finds a message's op records (the console's last reason, the
reconciliation's sums), through ``op_record_message_id_idx`` until this revision; no
statement looks one up by its ``id`` alone. The primary key was ``(id, message_id)`` (a
partitioned table's key must hold its partition key), so each delivery wrote two B-tree
entries that the key ``(message_id, id)`` alone covers: the relay's recording statement
wrote 449.6 B of WAL per message with both and 383.5 B with the one (BENCHMARKS.md,
"One index fewer per delivery, session 28").

The upgrade builds the key again over every range of retained history and holds ACCESS
EXCLUSIVE on ``op_record`` while it does: delivery waits (docs/operations.md, *Upgrading*).
The downgrade builds the old key and index again.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from alembic import op

from outbox.migrations import target_schema

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = target_schema()
    op.execute(f"ALTER TABLE {schema}.op_record DROP CONSTRAINT op_record_pkey")
    op.execute(f"DROP INDEX {schema}.op_record_message_id_idx")
    op.execute(f"ALTER TABLE {schema}.op_record ADD CONSTRAINT op_record_pkey "
               f"PRIMARY KEY (message_id, id)")


def downgrade() -> None:
    schema = target_schema()
    op.execute(f"ALTER TABLE {schema}.op_record DROP CONSTRAINT op_record_pkey")
    op.execute(f"ALTER TABLE {schema}.op_record ADD CONSTRAINT op_record_pkey "
               f"PRIMARY KEY (id, message_id)")
    op.execute(f"CREATE INDEX op_record_message_id_idx ON {schema}.op_record (message_id)")
