"""Retention's partition functions lock ``message`` itself, not each of its partitions.

``LOCK TABLE message`` on a partitioned table locks every partition too. Its SHARE UPDATE
EXCLUSIVE mode conflicts with autovacuum working on any partition, and the functions' 500 ms
lock timeout ends the wait before ``deadlock_timeout`` (1 s), after which PostgreSQL would
have cancelled the autovacuum in the way. At 11,000 msg/s (`make soak`) 27 retention passes
in 10 minutes timed out so, partitions piled up from 6 to 34 and the tables grew to 7.5 GB.
``LOCK TABLE ONLY`` still serialises the partition work against itself; each step locks the
partitions it touches itself (a drop without waiting, as before).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def partition_functions(schema: str, *, only: bool) -> str:
    """Revision 0006's functions, replaced in place (owner and grants stay), locking the
    parent ``message`` alone when ``only``."""
    path = Path(__file__).with_name("0006_partitioned_history.py")
    revision_0006 = load_module_py("outbox_revision_0006", path)
    functions: str = revision_0006.partition_functions(schema)
    functions = functions.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    whole = f"LOCK TABLE {schema}.message IN SHARE UPDATE EXCLUSIVE MODE"
    assert functions.count(whole) == 2, "revision 0006 locks message in two functions"
    return functions.replace(whole, whole.replace("LOCK TABLE", "LOCK TABLE ONLY")) if only \
        else functions


def upgrade() -> None:
    op.execute(partition_functions(target_schema(), only=True))


def downgrade() -> None:
    op.execute(partition_functions(target_schema(), only=False))
