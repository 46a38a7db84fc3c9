"""The rules on the hot tables' values live on domains, which a session reads once.

PostgreSQL keeps a table's CHECK constraints as text in the catalog and reads each back,
plans it and compiles it for every statement that writes the table. The publish's two
INSERTs did that for five constraints on every publish (message: shard, header keys;
pending: shard, status, resolution), and the relay's recording statement for op_record's
action: in a profile of pgbench publishing, ``ExecConstraints`` took 39 µs of a core per
publishing transaction, a quarter of the publish statement (BENCHMARKS.md, "Publishing,
session 25"). A domain's constraints are read once per session (PostgreSQL's type cache),
so the same rules on the columns' types cost next to nothing.

The columns become domains over their own types without constraints first, which rewrites
no table (only ``pending``'s four partial indexes, whose predicates name status and
resolution, are built again: they hold the queue's rows, not history); the table
constraints are dropped and the domains' added in the same transaction. The domains' are
added NOT VALID: every stored row has just passed the same rule as a table constraint, and
validating would read all of retained history. Every value written from now on is checked.
The ``message_state`` view is made again around the change (a view holds its columns' types).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27
"""

from collections import defaultdict
from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

ACTIONS = "('DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED', 'RESUMED')"
#: domain: (base type, its rule on VALUE, the table constraints it replaces, as
#: (table, column, name, rule))
DOMAINS = {
    "shard": ("smallint", "VALUE >= 0 AND VALUE < 64", (
        ("message", "shard", "message_shard_valid", "shard >= 0 AND shard < 64"),
        ("pending", "shard", "pending_shard_valid", "shard >= 0 AND shard < 64"))),
    "header_keys": ("text[]", "NOT (VALUE && ARRAY['content-type', 'outbox-id'])", (
        ("message", "header_keys", "message_headers_valid",
         "NOT (coalesce(header_keys, '{}') && ARRAY['content-type', 'outbox-id'])"),)),
    "pending_status": ("text", "VALUE IN ('PENDING', 'DELAYED', 'PARKED', 'DISCARDED')", (
        ("pending", "status", "pending_status_valid",
         "status IN ('PENDING', 'DELAYED', 'PARKED', 'DISCARDED')"),)),
    "pending_resolution": ("text", "VALUE IN ('COMMIT', 'UNKNOWN')", (
        ("pending", "resolution", "pending_resolution_valid",
         "resolution IN ('COMMIT', 'UNKNOWN')"),)),
    "op_action": ("text", f"VALUE IN {ACTIONS}", (
        ("op_record", "action", "op_record_action_valid", f"action IN {ACTIONS}"),)),
}


def message_state_view(schema: str) -> str:
    """The view as revision 0006 made it over the partitioned tables."""
    path = Path(__file__).with_name("0006_partitioned_history.py")
    revision_0006 = load_module_py("outbox_revision_0006", path)
    view: str = revision_0006.message_state_view(schema)
    return view


def columns_typed(schema: str, *, as_domains: bool) -> str:
    """One ALTER TABLE per table: its columns' types, and the table constraints dropped
    (``as_domains``) or added back."""
    changes: dict[str, list[str]] = defaultdict(list)
    for domain, (base, _rule, replaced) in DOMAINS.items():
        for table, column, name, rule in replaced:
            new_type = f"{schema}.{domain}" if as_domains else base
            changes[table].append(f"ALTER COLUMN {column} TYPE {new_type}")
            changes[table].append(f"DROP CONSTRAINT {name}" if as_domains
                                  else f"ADD CONSTRAINT {name} CHECK ({rule})")
    return "\n".join(f"ALTER TABLE {schema}.{table}\n    " + ",\n    ".join(parts)
                     + ";" for table, parts in changes.items())


def upgrade() -> None:
    schema = target_schema()
    for domain, (base, _rule, _replaced) in DOMAINS.items():
        op.execute(f"CREATE DOMAIN {schema}.{domain} AS {base}")
    op.execute(f"DROP VIEW {schema}.message_state")
    op.execute(columns_typed(schema, as_domains=True))
    for domain, (_base, rule, _replaced) in DOMAINS.items():
        op.execute(f"ALTER DOMAIN {schema}.{domain} ADD CONSTRAINT {domain}_valid "
                   f"CHECK ({rule}) NOT VALID")
    op.execute(message_state_view(schema))


def downgrade() -> None:
    schema = target_schema()
    op.execute(f"DROP VIEW {schema}.message_state")
    op.execute(columns_typed(schema, as_domains=False))
    for domain in DOMAINS:
        op.execute(f"DROP DOMAIN {schema}.{domain}")
    op.execute(message_state_view(schema))
