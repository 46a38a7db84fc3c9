"""Prepared rows stored without a check time get one.

Before revision 0018, ``publish_message()`` stored a prepared message (resolution UNKNOWN)
without ``check_after_seconds`` as given: its ``next_check_at`` was NULL, so no sweeper ever
claimed it, and it held the later messages of its key back for good. Such rows are due now:
the next sweeper checks them back like any other. (The other rows 0018 refuses, header arrays
that do not pair up, cannot be mended here: the relay parks them and the sweeper counts their
checks inconclusive, see store.UnpairedHeaders.)

The downgrade leaves the check times: they are what the rows should have had.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29
"""

from alembic import op

from outbox.migrations import target_schema

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(f"UPDATE {target_schema()}.pending SET next_check_at = now() "
               "WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED') "
               "AND next_check_at IS NULL")


def downgrade() -> None:
    pass
