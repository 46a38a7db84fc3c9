"""Create the prepare-row, op-record and relay-lease tables.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0001"
down_revision = None
branch_labels = ("outbox",)
depends_on = None

SHARDS = 64
RESOLUTIONS = "resolution IN ('COMMIT', 'ROLLBACK', 'UNKNOWN')"
STATUSES = "status IN ('PENDING', 'DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED')"
ACTIONS = "action IN ('DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED', 'RESUMED')"
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    schema = target_schema()
    op.create_table(
        "message",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("producer_group", sa.Text, nullable=False, server_default="default"),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("header_keys", sa.ARRAY(sa.Text)),
        sa.Column("header_values", sa.ARRAY(sa.LargeBinary)),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("resolution", sa.Text, nullable=False, server_default="COMMIT"),
        sa.Column("status", sa.Text, nullable=False, server_default="PENDING"),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("check_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_check_at", TIMESTAMP),
        sa.Column("deliver_after", TIMESTAMP),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("delivered_at", TIMESTAMP),
        sa.PrimaryKeyConstraint("id", name="message_pkey"),
        sa.CheckConstraint(RESOLUTIONS, name=op.f("message_resolution_valid")),
        sa.CheckConstraint(STATUSES, name=op.f("message_status_valid")),
        schema=schema,
    )
    op.create_index(
        "message_relay_idx", "message", ["id"], schema=schema,
        postgresql_where=sa.text("status = 'PENDING' AND resolution = 'COMMIT'"),
    )
    op.create_index(
        "message_check_idx", "message", ["next_check_at"], schema=schema,
        postgresql_where=sa.text("status = 'PENDING' AND resolution = 'UNKNOWN'"),
    )
    op.create_table(
        "op_record",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("message_id", sa.BigInteger, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("kafka_partition", sa.Integer),
        sa.Column("kafka_offset", sa.BigInteger),
        sa.Column("detail", sa.Text),
        sa.PrimaryKeyConstraint("id", name="op_record_pkey"),
        sa.CheckConstraint(ACTIONS, name=op.f("op_record_action_valid")),
        schema=schema,
    )
    op.create_index("op_record_message_id_idx", "op_record", ["message_id"], schema=schema)
    lease = op.create_table(
        "relay_lease",
        sa.Column("shard", sa.SmallInteger, autoincrement=False, nullable=False),
        sa.Column("owner", sa.Text),
        sa.Column("expires_at", TIMESTAMP),
        sa.PrimaryKeyConstraint("shard", name="relay_lease_pkey"),
        schema=schema,
    )
    op.bulk_insert(lease, [{"shard": shard} for shard in range(SHARDS)])
    op.create_table(
        "relay_member",
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("seen_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("worker_id", name="relay_member_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema = target_schema()
    for table in ("relay_member", "relay_lease", "op_record", "message"):
        op.drop_table(table, schema=schema)
