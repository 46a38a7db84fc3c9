"""Immutable message rows; the narrow ``pending`` table holds what is still to be done.

A delivery used to rewrite the whole message row (payload included) to mark it DELIVERED.
Now the publish statement writes the message row once and a narrow ``pending`` row beside it;
the relay deletes the pending row and writes the DELIVERED op record, so the op records are
the delivery ledger. Rows not yet finished (PENDING, DELAYED, PARKED, DISCARDED, UNKNOWN) move
into ``pending`` with their state, in place, and keep flowing. A finished row whose terminal
op record was already pruned gets one (actor ``migration 0004``), so every message's state
stays derivable: pending, else its last DELIVERED or ROLLED_BACK op record. The
``message_state`` view shows it the old way, for people and ad hoc queries.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)
UNFINISHED = "('PENDING', 'DELAYED', 'PARKED', 'DISCARDED')"
OLD_INDEXES = ("message_relay_idx", "message_check_idx", "message_hold_idx",
               "message_stuck_idx", "message_delayed_idx")
STATE_COLUMNS = ("resolution", "status", "check_count", "next_check_at", "attempts",
                 "last_error", "delivered_at")
HOLDS = (
    "key IS NOT NULL AND (status = 'DELAYED' OR (status = 'PENDING' AND resolution = 'UNKNOWN'))"
)
UNRESOLVED = "resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')"


def message_state_view(schema: str) -> str:
    """Every message with the state the pre-0004 ``message.status`` column held."""
    return f"""
CREATE VIEW {schema}.message_state AS
SELECT m.id, m.producer_group, m.topic, m.key, m.content_type, m.shard, m.created_at,
       m.deliver_after,
       coalesce(p.status, done.action) AS status,
       coalesce(p.resolution, CASE done.action WHEN 'DELIVERED' THEN 'COMMIT'
                                               WHEN 'ROLLED_BACK' THEN 'ROLLBACK' END)
           AS resolution,
       p.check_count, p.next_check_at, p.attempts, p.last_error,
       CASE WHEN done.action = 'DELIVERED' THEN done.created_at END AS delivered_at,
       done.kafka_partition, done.kafka_offset
FROM {schema}.message AS m
LEFT JOIN {schema}.pending AS p ON p.message_id = m.id
LEFT JOIN LATERAL (
    SELECT o.action, o.created_at, o.kafka_partition, o.kafka_offset
    FROM {schema}.op_record AS o
    WHERE o.message_id = m.id AND o.action IN ('DELIVERED', 'ROLLED_BACK')
    ORDER BY o.id
    LIMIT 1
) AS done ON p.message_id IS NULL"""


def upgrade() -> None:
    schema = target_schema()
    # Older applications and relays may still run (upgrade first, restart after): a publish
    # or delivery committed after the copies below and before the old columns are dropped
    # would be lost. Readers go on; writers wait until the upgrade commits.
    op.execute(f"LOCK TABLE {schema}.message, {schema}.op_record IN EXCLUSIVE MODE")
    op.create_table(
        "pending",
        sa.Column("message_id", sa.BigInteger, autoincrement=False, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("producer_group", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("resolution", sa.Text, nullable=False),
        sa.Column("deliver_after", TIMESTAMP),
        sa.Column("next_check_at", TIMESTAMP),
        sa.Column("check_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("message_id", name="pending_pkey"),
        sa.CheckConstraint("resolution IN ('COMMIT', 'UNKNOWN')",
                           name=op.f("pending_resolution_valid")),
        sa.CheckConstraint(f"status IN {UNFINISHED}", name=op.f("pending_status_valid")),
        schema=schema,
    )
    op.execute(f"""
        INSERT INTO {schema}.pending
            (message_id, shard, topic, key, producer_group, status, resolution, deliver_after,
             next_check_at, check_count, attempts, last_error, created_at)
        SELECT id, shard, topic, key, producer_group, status, resolution, deliver_after,
               next_check_at, check_count, attempts, last_error, created_at
        FROM {schema}.message WHERE status IN {UNFINISHED}""")
    op.execute(f"""
        INSERT INTO {schema}.op_record (message_id, action, actor, created_at, detail)
        SELECT m.id, m.status, 'migration 0004', coalesce(m.delivered_at, m.created_at),
               'the row''s status before revision 0004'
        FROM {schema}.message AS m
        WHERE m.status IN ('DELIVERED', 'ROLLED_BACK')
          AND NOT EXISTS (SELECT FROM {schema}.op_record AS o
                          WHERE o.message_id = m.id AND o.action = m.status)""")
    for index in OLD_INDEXES:
        op.drop_index(index, "message", schema=schema)
    for name in ("message_status_valid", "message_resolution_valid"):
        op.drop_constraint(op.f(name), "message", schema=schema)
    for column in STATE_COLUMNS:
        op.drop_column("message", column, schema=schema)
    op.create_index("pending_relay_idx", "pending", ["message_id"], schema=schema,
                    postgresql_where=sa.text("status = 'PENDING' AND resolution = 'COMMIT'"))
    op.create_index("pending_check_idx", "pending", ["next_check_at"], schema=schema,
                    postgresql_where=sa.text(UNRESOLVED))
    op.create_index("pending_hold_idx", "pending", ["topic", "key", "message_id"],
                    schema=schema, postgresql_where=sa.text(HOLDS))
    op.create_index("pending_delayed_idx", "pending", ["deliver_after"], schema=schema,
                    postgresql_where=sa.text("status = 'DELAYED'"))
    op.execute(message_state_view(schema))


def downgrade() -> None:
    schema = target_schema()
    op.execute(f"DROP VIEW {schema}.message_state")
    op.add_column("message", sa.Column("resolution", sa.Text, nullable=False,
                                       server_default="COMMIT"), schema=schema)
    op.add_column("message", sa.Column("status", sa.Text, nullable=False,
                                       server_default="DELIVERED"), schema=schema)
    op.add_column("message", sa.Column("check_count", sa.Integer, nullable=False,
                                       server_default="0"), schema=schema)
    op.add_column("message", sa.Column("next_check_at", TIMESTAMP), schema=schema)
    op.add_column("message", sa.Column("attempts", sa.Integer, nullable=False,
                                       server_default="0"), schema=schema)
    op.add_column("message", sa.Column("last_error", sa.Text), schema=schema)
    op.add_column("message", sa.Column("delivered_at", TIMESTAMP), schema=schema)
    op.execute(f"""
        UPDATE {schema}.message AS m
        SET status = 'ROLLED_BACK', resolution = 'ROLLBACK'
        FROM {schema}.op_record AS o
        WHERE o.message_id = m.id AND o.action = 'ROLLED_BACK'""")
    op.execute(f"""
        UPDATE {schema}.message AS m
        SET delivered_at = o.created_at
        FROM {schema}.op_record AS o
        WHERE o.message_id = m.id AND o.action = 'DELIVERED'""")
    op.execute(f"""
        UPDATE {schema}.message AS m
        SET status = p.status, resolution = p.resolution, check_count = p.check_count,
            next_check_at = p.next_check_at, attempts = p.attempts, last_error = p.last_error
        FROM {schema}.pending AS p
        WHERE p.message_id = m.id""")
    op.alter_column("message", "status", server_default="PENDING", schema=schema)
    op.create_check_constraint(op.f("message_resolution_valid"), "message",
                               "resolution IN ('COMMIT', 'ROLLBACK', 'UNKNOWN')", schema=schema)
    op.create_check_constraint(
        op.f("message_status_valid"), "message",
        "status IN ('PENDING', 'DELAYED', 'DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED')",
        schema=schema)
    op.create_index("message_relay_idx", "message", ["id"], schema=schema,
                    postgresql_where=sa.text("status = 'PENDING' AND resolution = 'COMMIT'"))
    op.create_index("message_check_idx", "message", ["next_check_at"], schema=schema,
                    postgresql_where=sa.text(UNRESOLVED))
    op.create_index("message_hold_idx", "message", ["topic", "key", "id"], schema=schema,
                    postgresql_where=sa.text(HOLDS))
    op.create_index("message_delayed_idx", "message", ["deliver_after"], schema=schema,
                    postgresql_where=sa.text("status = 'DELAYED'"))
    op.create_index("message_stuck_idx", "message", ["topic"], schema=schema,
                    postgresql_where=sa.text("status IN ('PARKED', 'DISCARDED')"))
    op.drop_table("pending", schema=schema)
