"""``decide_message()`` locks only a row it may change, before it reads what to answer.

It locked the message's pending row ``FOR UPDATE`` whatever it found, in the statement that
also read the answer. Two things followed:

* A decision that changes nothing (deciding again the same way, or deciding a message the
  relay is delivering) held the row until the application's transaction ended. The relay's
  statements that close a delivered batch, or promote due delayed rows, waited for it with
  no timeout: one application transaction left open stalled every shard of the relay.
* A decision that waited behind another one's ROLLBACK (which deletes the row) read the op
  records with the snapshot taken before its wait: it did not see ROLLED_BACK, and a COMMIT
  answered as if it had committed, where it must raise DecisionConflict.

Now a statement of its own locks the row only while it is UNKNOWN (PENDING, DELAYED or
DISCARDED), and the answer is read by the next statement, with a snapshot taken after any
decision this one waited for.

The downgrade puts revision 0020's function back.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

LOCKING_READ = """    RETURN QUERY
    WITH target AS (
        SELECT p.message_id, p.resolution, p.status FROM {schema}.pending AS p
        WHERE p.message_id = decide_message.message_id FOR UPDATE
    ), committed AS ("""
LOCK_THEN_READ = """    PERFORM FROM {schema}.pending AS p
    WHERE p.message_id = decide_message.message_id AND p.resolution = 'UNKNOWN'
      AND p.status IN ('PENDING', 'DELAYED', 'DISCARDED')
    FOR UPDATE;
    RETURN QUERY
    WITH target AS (
        SELECT p.message_id, p.resolution, p.status FROM {schema}.pending AS p
        WHERE p.message_id = decide_message.message_id
    ), committed AS ("""


def revision_0020(schema: str) -> str:
    """Revision 0020's function as ``CREATE OR REPLACE`` (its grants stay)."""
    path = Path(__file__).with_name("0020_a_rollback_wakes_the_relay.py")
    module = load_module_py("outbox_revision_0020", path)
    function: str = module.decide_message(schema, rollbacks_notify=True)
    return function


def decide_message(schema: str) -> str:
    function = revision_0020(schema)
    locking_read = LOCKING_READ.format(schema=schema)
    assert function.count(locking_read) == 1, "revision 0020's function locks in its query"
    return function.replace(locking_read, LOCK_THEN_READ.format(schema=schema))


def upgrade() -> None:
    op.execute(decide_message(target_schema()))


def downgrade() -> None:
    op.execute(revision_0020(target_schema()))
