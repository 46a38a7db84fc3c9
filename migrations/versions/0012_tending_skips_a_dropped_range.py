"""Tending a range another relay's pass dropped since the list was read skips it.

A retention pass lists the ranges of history, then tends each (revision 0011) in a
transaction of its own. Passes of different relays take turns for each creation and drop
(an advisory lock a function), not for a whole pass, so another relay may drop a range
between the listing and its turn. ``tend_range`` raised "not a range of ...'s history" for
it (seen in `make bench` with two relays), and the pass ended there, leaving every range
after it untended until the next pass.

``tend_range`` now answers ``gone`` for a name no table of the schema has; a name of a table
that is not a range still raises. Once found, a range cannot go before the function is done:
its lookup (``pg_get_expr`` of the range's bound) holds ACCESS SHARE on it until the end of
the transaction, and a drop needs ACCESS EXCLUSIVE. A drop committed while the lookup waited
for it leaves nothing to find, and answers ``gone`` as well.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

NOT_A_RANGE = """    IF part IS NULL THEN
        RAISE EXCEPTION"""
GONE = """    IF part IS NULL AND to_regclass(format('{schema}.%I', range_name)) IS NULL THEN
        RETURN 'gone';  -- dropped by another relay's pass since the list was read
    END IF;
    IF part IS NULL THEN
        RAISE EXCEPTION"""


def tend_range(schema: str, *, skip_gone: bool) -> str:
    """Revision 0011's function, replaced in place (owner and grants stay), answering
    ``gone`` for a range dropped since it was listed when ``skip_gone``."""
    path = Path(__file__).with_name("0011_retention_tends_ranges_of_history.py")
    revision_0011 = load_module_py("outbox_revision_0011", path)
    function: str = revision_0011.tend_range(schema)
    function = function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    assert function.count(NOT_A_RANGE) == 1, "revision 0011 raises for a name not a range"
    if not skip_gone:
        return function
    return function.replace(NOT_A_RANGE, GONE.replace("{schema}", schema))


def upgrade() -> None:
    op.execute(tend_range(target_schema(), skip_gone=True))


def downgrade() -> None:
    op.execute(tend_range(target_schema(), skip_gone=False))
