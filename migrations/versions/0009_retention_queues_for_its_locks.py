"""Retention's drop queues briefly for the parents' locks instead of giving up at once.

``drop_expired_partition`` locked the range to drop with NOWAIT, so that autovacuum at work
on it would not hold anyone up. But under load the range is nearly never free for an
instant:
- an application's session plans as PostgreSQL likes, and from its sixth publish the pending
  row's check (``pending_born_pending``, a lookup of ``message`` by id) runs a generic plan,
  which locks every partition of ``message`` until the transaction ends;
- the relay's fetch looks messages up by a joined id, so it locks every partition while it
  runs.
At 12,600 msg/s (`bench/soak.py --retention-only`) the server log showed each failed pass
finding the range held by a publishing statement or the fetch, and partitions piled up from
6 to 32 in six minutes where 14 hold the window.

Planning the check for each row instead locks one partition, but costs a publish about
110 µs more (`bench/publish_bench.py`: 360-381 µs against 263-287), a third of it. So the
drop now queues, and for the parents first: ACCESS EXCLUSIVE on ``message`` and
``op_record`` themselves, at most 100 ms a try, up to five tries 50 ms apart. Queued, it is
granted as soon as the statements reading through the parents end (milliseconds); the
statements arriving meanwhile wait behind it no longer than a try. The partitions are then
free of everyone but autovacuum, and are locked without waiting as before. The other order
(the range, then the parents for the DETACH) waited for the parents while holding the range,
which the statements in its way also wanted: each such pass ended on its 500 ms lock timeout
(10 of them in a 10-minute run at 12,900 msg/s).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from pathlib import Path

from alembic import op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: Tries at the oldest range's lock, each waiting this long, with a pause between them.
LOCK_ATTEMPTS = 5
LOCK_WAIT = "100ms"
PAUSE_SECONDS = 0.05

COMMENT = """\
        -- The partitions first, without waiting: while autovacuum works on one, waiting
        -- for it here would hold publishers up behind the parent's lock.
"""
GIVE_UP = """        BEGIN
            EXECUTE format('LOCK TABLE {schema}.%I, {schema}.%I IN ACCESS EXCLUSIVE MODE '
                           'NOWAIT', candidate.name, ops);
        EXCEPTION WHEN lock_not_available THEN
            RETURN;
        END;
"""
QUEUE = f"""\
        -- The parents first, queued (at most {LOCK_WAIT} a try): then every statement that
        -- read a partition through them (the relay's fetch, a publish's check) has ended,
        -- and none starts until this commits. A lock_timeout set in a try that fails is
        -- undone with it; one that succeeds is put back. Then the partitions, without
        -- waiting: only autovacuum can hold one now.
        FOR attempt IN 1..{LOCK_ATTEMPTS} LOOP
            BEGIN
                patience := current_setting('lock_timeout');
                PERFORM set_config('lock_timeout', '{LOCK_WAIT}', true);
                LOCK TABLE ONLY {{schema}}.message, ONLY {{schema}}.op_record
                    IN ACCESS EXCLUSIVE MODE;
                PERFORM set_config('lock_timeout', patience, true);
                EXIT;
            EXCEPTION WHEN lock_not_available THEN
                IF attempt = {LOCK_ATTEMPTS} THEN
                    RETURN;
                END IF;
                PERFORM pg_sleep({PAUSE_SECONDS});
            END;
        END LOOP;
{{give_up}}"""
DECLARED = "    moved bigint;\nBEGIN"


def partition_functions(schema: str, *, queue: bool) -> str:
    """Revision 0008's functions, the drop queueing for its lock when ``queue``."""
    path = Path(__file__).with_name("0008_retention_locks_only_the_parent.py")
    revision_0008 = load_module_py("outbox_revision_0008", path)
    functions: str = revision_0008.partition_functions(schema, only=True)
    give_up = GIVE_UP.replace("{schema}", schema)
    assert functions.count(COMMENT + give_up) == 1, "revision 0006's drop locks with NOWAIT"
    assert functions.count(DECLARED) == 1, "revision 0006's drop declares `moved` last"
    if not queue:
        return functions
    functions = functions.replace(DECLARED, DECLARED.replace("BEGIN", "    patience text;\nBEGIN"))
    queue_first = QUEUE.replace("{schema}", schema).replace("{give_up}", give_up)
    return functions.replace(COMMENT + give_up, queue_first)


def upgrade() -> None:
    op.execute(partition_functions(target_schema(), queue=True))


def downgrade() -> None:
    op.execute(partition_functions(target_schema(), queue=False))
