"""``decide_message()`` wakes the relay for a rollback too, not only for a commit.

A prepared message (UNKNOWN) holds back the later messages of its key. Rolled back by the
application, it frees them, but the function notified only when a row became PENDING: a
sleeping relay found them at its next poll (``relay_poll_interval``, up to an hour). The
sweeper's check-backs notify for rollbacks since the same change (outbox/sql/queries.sql).

The downgrade puts revision 0005's function back.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

COMMITS_NOTIFY = "WHERE c.status = 'PENDING')"
DECISIONS_NOTIFY = "WHERE c.status IN ('PENDING', 'ROLLED_BACK'))"


def decide_message(schema: str, *, rollbacks_notify: bool) -> str:
    """Revision 0005's function as ``CREATE OR REPLACE`` (its grants stay); with
    ``rollbacks_notify``, a rollback notifies as a commit does."""
    path = Path(__file__).with_name("0005_rows_roles_cannot_forge.py")
    revision_0005 = load_module_py("outbox_revision_0005", path)
    function: str = revision_0005.decide_message(schema)
    assert function.count(COMMITS_NOTIFY) == 1, "revision 0005's function notifies once"
    function = function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    return function.replace(COMMITS_NOTIFY, DECISIONS_NOTIFY) if rollbacks_notify else function


def upgrade() -> None:
    op.execute(decide_message(target_schema(), rollbacks_notify=True))


def downgrade() -> None:
    op.execute(decide_message(target_schema(), rollbacks_notify=False))
