"""``publish_message()`` refuses rows the relay and the sweeper could not read back.

The application's role calls the function with its own arguments. Header names and values of
different lengths, a NULL among them, or arrays of more than one dimension were stored as
given; the relay pairs them up for every record it sends and the sweeper for every message it
checks, so one such row ended every relay that fetched it (and the sweeper), again at each
restart. A prepared message (resolution UNKNOWN) without ``check_after_seconds`` had no time
of its first check-back: never checked, it held its key back for good. Both are refused now,
with SQLSTATE 22023 (invalid_parameter_value). The library never sends either.

The downgrade puts revision 0014's function back.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

BEGUN = """BEGIN
    IF lock_key IS NOT NULL THEN"""
CHECKS = """BEGIN
    IF coalesce(cardinality(header_keys), 0) <> coalesce(cardinality(header_values), 0)
            OR array_ndims(header_keys) > 1 OR array_ndims(header_values) > 1
            OR array_position(header_keys, NULL) IS NOT NULL
            OR array_position(header_values, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'header_keys and header_values must pair up, one name to one value, '
                        'none of them NULL' USING ERRCODE = '22023';
    END IF;
    IF publish_message.resolution = 'UNKNOWN' AND check_after_seconds IS NULL THEN
        RAISE EXCEPTION 'a prepared message (resolution UNKNOWN) needs check_after_seconds'
            USING ERRCODE = '22023';
    END IF;
    IF lock_key IS NOT NULL THEN"""


def publish_message(schema: str, *, checked: bool) -> str:
    """Revision 0014's function as ``CREATE OR REPLACE`` (its grants stay), with the checks
    of this revision when ``checked``."""
    path = Path(__file__).with_name("0014_publish_through_one_function.py")
    revision_0014 = load_module_py("outbox_revision_0014", path)
    function: str = revision_0014.publish_message(schema)
    assert function.count(BEGUN) == 1, "revision 0014's function begins with the key's lock"
    function = function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    return function.replace(BEGUN, CHECKS) if checked else function


def upgrade() -> None:
    op.execute(publish_message(target_schema(), checked=True))


def downgrade() -> None:
    op.execute(publish_message(target_schema(), checked=False))
