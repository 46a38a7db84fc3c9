"""Delayed status, key holds, status indexes, relay in-flight counts, retention indexes.

A DELAYED row waits for its deliver_after time; rows still UNKNOWN or DELAYED hold back later
rows of the same key (found through message_hold_idx). PARKED and DISCARDED rows are found
through their own small index; relays report their in-flight messages for `outbox status`.
Retention prunes by created_at (BRIN).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_STATUSES = "status IN ('PENDING', 'DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED')"
NEW_STATUSES = (
    "status IN ('PENDING', 'DELAYED', 'DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED')"
)
HOLDS = (
    "key IS NOT NULL AND (status = 'DELAYED' OR (status = 'PENDING' AND resolution = 'UNKNOWN'))"
)
STUCK = "status IN ('PARKED', 'DISCARDED')"
UNRESOLVED = "resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')"


def upgrade() -> None:
    schema = target_schema()
    op.drop_constraint(op.f("message_status_valid"), "message", schema=schema)
    op.create_check_constraint(
        op.f("message_status_valid"), "message", NEW_STATUSES, schema=schema
    )
    op.drop_index("message_check_idx", "message", schema=schema)
    op.create_index("message_check_idx", "message", ["next_check_at"], schema=schema,
                    postgresql_where=sa.text(UNRESOLVED))
    op.create_index("message_hold_idx", "message", ["topic", "key", "id"], schema=schema,
                    postgresql_where=sa.text(HOLDS))
    op.create_index("message_delayed_idx", "message", ["deliver_after"], schema=schema,
                    postgresql_where=sa.text("status = 'DELAYED'"))
    op.create_index("message_stuck_idx", "message", ["topic"], schema=schema,
                    postgresql_where=sa.text(STUCK))
    op.add_column("relay_member", sa.Column("in_flight", sa.Integer, nullable=False,
                                            server_default="0"), schema=schema)
    op.create_index("message_created_at_idx", "message", ["created_at"], schema=schema,
                    postgresql_using="brin")
    op.create_index("op_record_created_at_idx", "op_record", ["created_at"], schema=schema,
                    postgresql_using="brin")


def downgrade() -> None:
    schema = target_schema()
    op.drop_index("op_record_created_at_idx", "op_record", schema=schema)
    op.drop_index("message_created_at_idx", "message", schema=schema)
    op.drop_column("relay_member", "in_flight", schema=schema)
    op.drop_index("message_stuck_idx", "message", schema=schema)
    op.drop_index("message_delayed_idx", "message", schema=schema)
    op.drop_index("message_hold_idx", "message", schema=schema)
    op.drop_index("message_check_idx", "message", schema=schema)
    op.create_index("message_check_idx", "message", ["next_check_at"], schema=schema,
                    postgresql_where=sa.text("status = 'PENDING' AND resolution = 'UNKNOWN'"))
    op.execute(f"UPDATE {schema}.message SET status = 'PENDING' WHERE status = 'DELAYED'")
    op.drop_constraint(op.f("message_status_valid"), "message", schema=schema)
    op.create_check_constraint(
        op.f("message_status_valid"), "message", OLD_STATUSES, schema=schema
    )
