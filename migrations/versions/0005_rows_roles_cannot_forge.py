"""Rows no role can forge: valid shards, no reserved headers, pending rows born pending,
decisions through one function.

* ``message`` and ``pending``: ``shard`` within 0..SHARDS-1 (a row on shard 999 would never
  be delivered); ``message.header_keys`` never holds ``outbox-id`` or ``content-type`` (the
  relay adds those; a forged one would come first in the record).
* A pending row can only be inserted PENDING or DELAYED, unchecked, unattempted, beside a
  message row written at the same moment by the same transaction (same ``created_at`` =
  ``now()``) with the same shard, topic, key and producer group: nobody can revive a finished
  message or give a new one a state it did not earn.
* ``decide_message()``: an application's COMMIT or ROLLBACK of an UNKNOWN message, run with
  the schema owner's rights (SECURITY DEFINER, pinned search_path), so the application's
  role needs no UPDATE or DELETE on ``pending`` and no INSERT on ``op_record``. A producer
  group listed in ``producer_group_role`` is decided only by members of its role.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations import target_schema

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

SHARD_VALID = "shard >= 0 AND shard < 64"
HEADERS_VALID = "NOT (coalesce(header_keys, '{}') && ARRAY['content-type', 'outbox-id'])"


def born_pending(schema: str) -> str:
    return f"""
CREATE FUNCTION {schema}.pending_born_pending() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
BEGIN
    IF NEW.status NOT IN ('PENDING', 'DELAYED') OR NEW.check_count <> 0
       OR NEW.attempts <> 0 OR NEW.last_error IS NOT NULL OR NEW.created_at <> now()
       OR NOT EXISTS (
           SELECT FROM {schema}.message AS m
           WHERE m.id = NEW.message_id AND m.created_at = now() AND m.shard = NEW.shard
             AND m.topic = NEW.topic AND m.key IS NOT DISTINCT FROM NEW.key
             AND m.producer_group = NEW.producer_group)
    THEN
        RAISE EXCEPTION 'a pending row is written only by the publish statement, beside its '
                        'new message (message %)', NEW.message_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$body$;
CREATE TRIGGER pending_born_pending BEFORE INSERT ON {schema}.pending
FOR EACH ROW EXECUTE FUNCTION {schema}.pending_born_pending();"""


def decide_message(schema: str) -> str:
    """The body of the ``decide`` query of revision 0004 as a SECURITY DEFINER function, which
    also refuses a caller whose producer group is bound to a role it is not a member of."""
    return f"""
CREATE FUNCTION {schema}.decide_message(
    message_id bigint, resolution text, actor text, channel text
) RETURNS TABLE (was_resolution text, decided boolean, notified bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
#variable_conflict use_column
DECLARE
    bound text;
BEGIN
    SELECT b.role INTO bound
    FROM {schema}.message AS m JOIN {schema}.producer_group_role AS b
         ON b.producer_group = m.producer_group
    WHERE m.id = decide_message.message_id AND NOT pg_has_role(session_user, b.role, 'MEMBER');
    IF FOUND THEN
        RAISE EXCEPTION 'permission denied: % may decide message % only as a member of %',
                        session_user, decide_message.message_id, bound
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN QUERY
    WITH target AS (
        SELECT p.message_id, p.resolution, p.status FROM {schema}.pending AS p
        WHERE p.message_id = decide_message.message_id FOR UPDATE
    ), committed AS (
        UPDATE {schema}.pending AS p
        SET resolution = 'COMMIT',
            status = CASE WHEN p.status = 'DISCARDED' AND p.deliver_after > now() THEN 'DELAYED'
                          WHEN p.status = 'DISCARDED' THEN 'PENDING' ELSE p.status END,
            next_check_at = NULL
        FROM target
        WHERE decide_message.resolution = 'COMMIT' AND p.message_id = target.message_id
          AND p.resolution = 'UNKNOWN' AND p.status IN ('PENDING', 'DELAYED', 'DISCARDED')
        RETURNING p.message_id, p.status, target.status AS was
    ), rolled_back AS (
        DELETE FROM {schema}.pending AS p
        USING target
        WHERE decide_message.resolution = 'ROLLBACK' AND p.message_id = target.message_id
          AND p.resolution = 'UNKNOWN' AND p.status IN ('PENDING', 'DELAYED', 'DISCARDED')
        RETURNING p.message_id, 'ROLLED_BACK'::text AS status, target.status AS was
    ), changed AS (
        SELECT * FROM committed UNION ALL SELECT * FROM rolled_back
    ), recorded AS (
        INSERT INTO {schema}.op_record (message_id, action, actor, detail)
        SELECT c.message_id,
               CASE WHEN c.status = 'ROLLED_BACK' THEN 'ROLLED_BACK' ELSE 'RESUMED' END,
               decide_message.actor,
               CASE WHEN c.was = 'DISCARDED' THEN 'was DISCARDED; ' ELSE '' END
               || 'decided ' || decide_message.resolution || ' by the application'
        FROM changed AS c WHERE c.status = 'ROLLED_BACK' OR c.was = 'DISCARDED'
    ), finished AS (
        SELECT CASE WHEN EXISTS (SELECT FROM {schema}.op_record AS o
                                 WHERE o.message_id = m.id AND o.action = 'ROLLED_BACK')
                    THEN 'ROLLBACK' ELSE 'COMMIT' END AS resolution
        FROM {schema}.message AS m
        WHERE m.id = decide_message.message_id AND NOT EXISTS (SELECT FROM target)
    )
    SELECT t.resolution, EXISTS (SELECT FROM changed),
           (SELECT count(pg_notify(decide_message.channel, '')) FROM changed AS c
            WHERE c.status = 'PENDING')
    FROM target AS t
    UNION ALL
    SELECT f.resolution, false, 0::bigint FROM finished AS f;
END
$body$;
REVOKE ALL ON FUNCTION {schema}.decide_message(bigint, text, text, text) FROM PUBLIC;"""


def upgrade() -> None:
    schema = target_schema()
    op.create_table(
        "producer_group_role",
        sa.Column("producer_group", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("producer_group", name="producer_group_role_pkey"),
        schema=schema,
    )
    for table in ("message", "pending"):
        op.create_check_constraint(op.f(f"{table}_shard_valid"), table, SHARD_VALID,
                                   schema=schema)
    op.create_check_constraint(op.f("message_headers_valid"), "message", HEADERS_VALID,
                               schema=schema)
    op.execute(born_pending(schema))
    op.execute(decide_message(schema))


def downgrade() -> None:
    schema = target_schema()
    op.execute(f"DROP FUNCTION {schema}.decide_message(bigint, text, text, text)")
    op.execute(f"DROP TRIGGER pending_born_pending ON {schema}.pending")
    op.execute(f"DROP FUNCTION {schema}.pending_born_pending()")
    op.drop_constraint(op.f("message_headers_valid"), "message", schema=schema)
    op.drop_table("producer_group_role", schema=schema)
    for table in ("message", "pending"):
        op.drop_constraint(op.f(f"{table}_shard_valid"), table, schema=schema)
