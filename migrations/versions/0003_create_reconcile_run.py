"""The reconcile_run table: one summary row per Spark reconciliation run.

The newest row's window_until and kafka_offsets are the watermark the next incremental run
starts from; the findings themselves are written as files under the run's output_path.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from outbox.migrations import target_schema

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OUTCOMES = "outcome IN ('CLEAN', 'FINDINGS', 'FAILED')"
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "reconcile_run",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("window_since", TIMESTAMP),
        sa.Column("window_until", TIMESTAMP, nullable=False),
        sa.Column("read_topics", sa.Boolean, nullable=False),
        sa.Column("kafka_offsets", JSONB),
        sa.Column("messages", sa.BigInteger, nullable=False),
        sa.Column("op_records", sa.BigInteger, nullable=False),
        sa.Column("kafka_records", sa.BigInteger),
        sa.Column("findings", JSONB, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("output_path", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("id", name="reconcile_run_pkey"),
        sa.CheckConstraint(OUTCOMES, name=op.f("reconcile_run_outcome_valid")),
        schema=target_schema(),
    )


def downgrade() -> None:
    op.drop_table("reconcile_run", schema=target_schema())
