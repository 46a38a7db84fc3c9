"""Each relay's heartbeat says whether it is paused, since when and why, for `outbox status`
and the console (its log and ``outbox_relay_paused`` said it; the database did not).

Two nullable columns on ``relay_member``: adding them rewrites nothing. A relay of an
earlier release leaves them NULL (not paused).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = target_schema()
    op.add_column("relay_member", sa.Column("paused_since", sa.DateTime(timezone=True)),
                  schema=schema)
    op.add_column("relay_member", sa.Column("paused_reason", sa.Text), schema=schema)


def downgrade() -> None:
    schema = target_schema()
    op.drop_column("relay_member", "paused_reason", schema=schema)
    op.drop_column("relay_member", "paused_since", schema=schema)
