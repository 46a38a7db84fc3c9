"""The queue keeps its pages: VACUUM no longer truncates ``pending``.

``pending`` is a queue. A backlog fills it, the relay drains it in id order, and new rows go
to the space vacuum freed at its front, so after a drain its last pages are empty and the
next VACUUM truncates them. Truncating takes ACCESS EXCLUSIVE on the table: every publish
and every fetch waits behind it, and a hot standby replays the lock, cancelling its readers
of the table. With 200 MB of drained queue and four publishers at work, VACUUM took 0.6-1.7 s
with the truncation and the publishers' slowest commit during it 72-77 ms; without it,
0.3 s and 18-24 ms (`bench/queue_vacuum.py`, BENCHMARKS.md). The next backlog then had to
extend the table again, page by page under the relation's extension lock.

With ``vacuum_truncate = false`` the empty pages stay, and are reused through the free space
map: the table keeps the size of its largest backlog, which it had reached anyway.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

from alembic import op

from outbox.migrations import target_schema

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(f"ALTER TABLE {target_schema()}.pending SET (vacuum_truncate = false)")


def downgrade() -> None:
    op.execute(f"ALTER TABLE {target_schema()}.pending RESET (vacuum_truncate)")
