"""Publishing goes through one function, which no longer looks its own message up.

The publish statement inserted the message row and its pending row, and revision 0005's
trigger checked each pending row against ``message``: a plpgsql call and a lookup by id for
every publish. An application's session plans that lookup generically from its sixth
publish, and a generic plan locks every partition of ``message`` until the transaction ends
(14 of 14 in `test_query_plans.py`, 2 for the first five publishes; through the function
1): retention's drops queue behind it (revision 0009), and publishers wait while a new range
is attached, for ATTACH locks the default partition exclusively (BENCHMARKS.md, session 19).

``publish_message()`` writes both rows with the schema owner's rights (SECURITY DEFINER,
``search_path`` pinned). It takes every column the trigger checks (id, shard, topic, key,
producer group, creation time) from the message row it has just inserted, and starts the
row PENDING or DELAYED, unchecked and unattempted, so its rows need no check: the trigger
now skips the owner's rows (a WHEN clause, evaluated without calling the trigger) and still
checks every other role's. It is the application role's only way to write the rows once
`outbox db upgrade --create-roles` has run again, which takes INSERT on ``message`` and
``pending`` from the role; this revision leaves that INSERT, so that applications still
running the older statement keep publishing while they are upgraded.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

from alembic import op

from outbox.migrations import target_schema

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def publish_message(schema: str) -> str:
    """The publish statement of revision 0004 (a keyed row's advisory lock before its id is
    drawn, the pending row beside it, the wake-up) as the function the application calls."""
    return f"""
CREATE FUNCTION {schema}.publish_message(
    producer_group text, topic text, key bytea, header_keys text[], header_values bytea[],
    payload bytea, content_type text, shard smallint, deliver_at timestamptz,
    delay_seconds double precision, resolution text, check_after_seconds double precision,
    lock_class integer, lock_key integer, notify boolean, wake_class integer,
    wake_base integer, channel text, delayed_note text
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
    due timestamptz := coalesce(deliver_at, now() + make_interval(secs => delay_seconds));
    state text := CASE WHEN due > now() THEN 'DELAYED' ELSE 'PENDING' END;
    new_id bigint;
BEGIN
    IF lock_key IS NOT NULL THEN  -- rows of one key get their ids in commit order
        PERFORM pg_advisory_xact_lock(lock_class, lock_key);
    END IF;
    INSERT INTO {schema}.message AS m
        (producer_group, topic, key, header_keys, header_values, payload, content_type, shard,
         deliver_after)
    VALUES (publish_message.producer_group, publish_message.topic, publish_message.key,
            publish_message.header_keys, publish_message.header_values,
            publish_message.payload, publish_message.content_type, publish_message.shard, due)
    RETURNING m.id INTO new_id;
    INSERT INTO {schema}.pending
        (message_id, shard, topic, key, producer_group, status, resolution, deliver_after,
         next_check_at, created_at)
    VALUES (new_id, publish_message.shard, publish_message.topic, publish_message.key,
            publish_message.producer_group, state, publish_message.resolution, due,
            now() + make_interval(secs => check_after_seconds), now());
    IF notify AND (state = 'DELAYED' OR NOT pg_try_advisory_xact_lock_shared(
                       wake_class, wake_base + publish_message.shard)) THEN
        PERFORM pg_notify(channel, CASE WHEN state = 'DELAYED' THEN delayed_note ELSE '' END);
    END IF;
    RETURN new_id;
END
$body$;
REVOKE ALL ON FUNCTION {schema}.publish_message FROM PUBLIC;"""


def born_pending_trigger(schema: str, unless_owner: bool) -> str:
    """Revision 0005's trigger, checking every row or (``unless_owner``) every row but those
    of the role running this migration, which owns ``publish_message()``."""
    skip = "WHEN (current_user <> %L) " if unless_owner else ""
    return f"""
DROP TRIGGER pending_born_pending ON {schema}.pending;
DO $trigger$
BEGIN
    EXECUTE format('CREATE TRIGGER pending_born_pending BEFORE INSERT ON {schema}.pending '
                   'FOR EACH ROW {skip}EXECUTE FUNCTION {schema}.pending_born_pending()',
                   current_user);
END
$trigger$;"""


def app_rights(schema: str, through_function: bool) -> str:
    """An application role made before this revision may call the function. It keeps INSERT on
    the tables (each row still checked by the trigger), so applications still running the
    older statement keep publishing until `outbox db upgrade --create-roles` takes it back;
    after a downgrade it has revision 0005's INSERT, whatever it had."""
    rights = (f"GRANT EXECUTE ON FUNCTION {schema}.publish_message TO {schema}_app;"
              if through_function else
              f"GRANT INSERT (producer_group, topic, key, header_keys, header_values, payload,\n"
              f"              content_type, shard, deliver_after) ON {schema}.message\n"
              f"    TO {schema}_app;\n"
              f"GRANT INSERT (message_id, shard, topic, key, producer_group, status, resolution,\n"
              f"              deliver_after, next_check_at, created_at) ON {schema}.pending\n"
              f"    TO {schema}_app;")
    return f"""
DO $grant$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_app') THEN
        {rights}
    END IF;
END
$grant$;"""


def upgrade() -> None:
    schema = target_schema()
    op.execute(publish_message(schema))
    op.execute(born_pending_trigger(schema, unless_owner=True))
    op.execute(app_rights(schema, through_function=True))


def downgrade() -> None:
    schema = target_schema()
    op.execute(app_rights(schema, through_function=False))
    op.execute(born_pending_trigger(schema, unless_owner=False))
    op.execute(f"DROP FUNCTION {schema}.publish_message")
