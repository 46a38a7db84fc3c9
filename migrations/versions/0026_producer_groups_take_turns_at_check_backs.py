"""Producer groups take turns at check-backs: ``pending_check_idx`` lists the due rows of
each group apart.

A sweeper claimed the due UNKNOWN rows of all its groups oldest first, through an index of
``next_check_at``. A backlog of one group's checks (its checker slow, or a burst of
two-phase messages) then held back every other group's, all due later, until the whole
backlog was checked: with 8 slots and checks of 5 s, 1,000 rows made the others wait ten
minutes. The claim now takes the groups in turn (queries.sql, ``claim_checks``), each from
its own range of the index, ``(producer_group, next_check_at)``.

The index is built again, which holds writes to ``pending`` while it builds (it lists only
the UNKNOWN rows). The downgrade builds the old one.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

UNRESOLVED = "resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')"


def upgrade() -> None:
    _index("producer_group", "next_check_at")


def downgrade() -> None:
    _index("next_check_at")


def _index(*columns: str) -> None:
    schema = target_schema()
    op.drop_index("pending_check_idx", "pending", schema=schema)
    op.create_index("pending_check_idx", "pending", list(columns), schema=schema,
                    postgresql_where=sa.text(UNRESOLVED))
