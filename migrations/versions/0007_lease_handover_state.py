"""Leases remember whether their shard was handed over cleanly, and since when its sends may
be unrecorded, so a new owner knows when it must read the topic's tail before sending.

* ``relay_lease.clean``: the last owner handed the shard back with every message it sent
  recorded (a graceful stop or a rebalance). A claim sets it false; a relay killed with -9
  leaves it false, and the next owner reads the tail (relay/recovery.py).
* ``relay_lease.settled_at``: every message of the shard sent before this moment has its op
  record (NULL: not known, from the beginning). Set when a clean shard is claimed and after
  a tail has been read; a message can only have landed unrecorded after it (and after its
  own commit).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = target_schema()
    op.add_column("relay_lease", sa.Column("clean", sa.Boolean, nullable=False,
                                           server_default=sa.true()), schema=schema)
    op.add_column("relay_lease", sa.Column("settled_at", sa.DateTime(timezone=True)),
                  schema=schema)
    # A shard owned right now may have sends in flight that are not recorded yet.
    op.execute(f"UPDATE {schema}.relay_lease SET clean = false WHERE owner IS NOT NULL")


def downgrade() -> None:
    schema = target_schema()
    op.drop_column("relay_lease", "settled_at", schema=schema)
    op.drop_column("relay_lease", "clean", schema=schema)
