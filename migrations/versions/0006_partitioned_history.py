"""``message`` and ``op_record`` partitioned by ranges of message id: retention drops whole
partitions, so its cost does not grow with the rows it removes.

* Range on the message id (``op_record`` on its ``message_id``, with the same bounds): every
  lookup of a message by id reaches one partition, the primary key of ``message`` stays
  ``id``, and a message's op records live and die with it. ``op_record``'s key becomes
  ``(id, message_id)`` (a partitioned table's key must hold the partition key).
* Data in place: the old tables are attached as the first partitions (ids up to the
  sequence's current value), nothing is copied; the sequences carry on.
* A DEFAULT partition on each table takes any id no range partition covers yet, so a publish
  never fails for want of a partition.
* Three SECURITY DEFINER functions do what needs the owner's rights, so the relay's role needs
  none on partitions: ``ensure_partitions`` creates the next ranges ahead of the sequence,
  ``drop_expired_partition`` drops the oldest partition whose rows are all past the retention
  window and none of which waits for the relay (moving its other unfinished messages --
  parked, discarded, delayed, unresolved -- and their op records into the default partition
  first), and ``prune_default`` deletes expired finished rows of the default partitions in
  bounded batches.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import context, op
from alembic.util.pyfiles import load_module_py

from outbox.migrations import target_schema

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)
SHARD_VALID = "shard >= 0 AND shard < 64"
HEADERS_VALID = "NOT (coalesce(header_keys, '{}') && ARRAY['content-type', 'outbox-id'])"
#: Message ids per partition (unless ``outbox.migrate.upgrade`` says otherwise), and how many
#: partitions to keep ready beyond the sequence.
PARTITION_SIZE = 1_000_000
AHEAD = 2
MESSAGE_COLUMNS = ("id, producer_group, topic, key, header_keys, header_values, payload, "
                   "content_type, shard, deliver_after, created_at")
OP_RECORD_COLUMNS = ("id, message_id, action, actor, created_at, kafka_partition, "
                     "kafka_offset, detail")
#: Partition DDL waits at most this long for a lock, then gives up until the next pass: a
#: long transaction never makes publishers queue behind it.
LOCK_TIMEOUT = "500ms"
#: Namespace of the advisory lock one retention step holds (outbox/store.py has the others).
RETENTION_LOCK_CLASS = 0x0B0F
FUNCTIONS = ("ensure_partitions(bigint, integer)", "drop_expired_partition(double precision)",
             "prune_default(double precision, integer)", "partition_bounds(regclass)")


def aliased(columns: str, alias: str) -> str:
    return ", ".join(f"{alias}.{column}" for column in columns.split(", "))


def message_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("producer_group", sa.Text, nullable=False, server_default="default"),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("header_keys", sa.ARRAY(sa.Text)),
        sa.Column("header_values", sa.ARRAY(sa.LargeBinary)),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("deliver_after", TIMESTAMP),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
    ]


def op_record_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("message_id", sa.BigInteger, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("kafka_partition", sa.Integer),
        sa.Column("kafka_offset", sa.BigInteger),
        sa.Column("detail", sa.Text),
    ]


def create_message(name: str, schema: str, key: tuple[str, ...], **partitioned: Any) -> None:
    op.create_table(
        name, *message_columns(),
        sa.PrimaryKeyConstraint(*key, name=op.f(f"{name}_pkey")),
        sa.CheckConstraint(SHARD_VALID, name=op.f("message_shard_valid")),
        sa.CheckConstraint(HEADERS_VALID, name=op.f("message_headers_valid")),
        schema=schema, **partitioned,
    )


def create_op_record(name: str, schema: str, key: tuple[str, ...], **partitioned: Any) -> None:
    op.create_table(
        name, *op_record_columns(),
        sa.PrimaryKeyConstraint(*key, name=op.f(f"{name}_pkey")),
        sa.CheckConstraint("action IN ('DELIVERED', 'ROLLED_BACK', 'PARKED', 'DISCARDED', "
                           "'RESUMED')", name=op.f("op_record_action_valid")),
        schema=schema, **partitioned,
    )


def create_indexes(schema: str) -> None:
    op.create_index("message_created_at_idx", "message", ["created_at"], schema=schema,
                    postgresql_using="brin")
    op.create_index("op_record_message_id_idx", "op_record", ["message_id"], schema=schema)
    op.create_index("op_record_created_at_idx", "op_record", ["created_at"], schema=schema,
                    postgresql_using="brin")


def partition_functions(schema: str) -> str:
    """The owner's partition work, for roles that own nothing (see the module docstring)."""
    definer = "SECURITY DEFINER SET search_path = pg_catalog, pg_temp"
    next_id = (f"(SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
               f"FROM {schema}.message_id_seq)")
    # Relays run their passes independently: one at a time works, the others skip quietly.
    one_pass = f"pg_try_advisory_xact_lock({RETENTION_LOCK_CLASS}, hashtext('{schema}'))"
    return f"""
CREATE FUNCTION {schema}.partition_bounds(parent regclass)
RETURNS TABLE (name text, low bigint, high bigint)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $body$
    SELECT c.relname::text,
           CAST(nullif(substring(b.bound FROM 'FROM \\(''?([-0-9]+|MINVALUE)'), 'MINVALUE')
                AS bigint),
           CAST(substring(b.bound FROM 'TO \\(''?(-?[0-9]+)') AS bigint)
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid,
    LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) AS b
    WHERE i.inhparent = parent AND b.bound <> 'DEFAULT'
$body$;

CREATE FUNCTION {schema}.ensure_partitions(size bigint, ahead integer) RETURNS integer
LANGUAGE plpgsql {definer} SET lock_timeout = '{LOCK_TIMEOUT}' AS $body$
DECLARE
    next_id bigint;
    top bigint;
    low bigint;
    goal bigint;
    made integer := 0;
BEGIN
    IF NOT {one_pass} THEN
        RETURN 0;
    END IF;
    LOCK TABLE {schema}.message IN SHARE UPDATE EXCLUSIVE MODE;
    next_id := {next_id};
    SELECT max(b.high) INTO top FROM {schema}.partition_bounds('{schema}.message') AS b;
    low := coalesce(top, next_id);
    goal := next_id + ahead * size;
    IF low < next_id THEN
        -- The sequence ran past the last range (its newest rows went to the default
        -- partition): leave one range of ids to the default partition, clear of inserts
        -- running now, and start after it.
        low := next_id + size;
        goal := goal + size;
    END IF;
    WHILE low < goal LOOP
        EXECUTE format('CREATE TABLE {schema}.%I (LIKE {schema}.message INCLUDING DEFAULTS '
                       'INCLUDING CONSTRAINTS)', 'message_p' || low);
        EXECUTE format('ALTER TABLE {schema}.message ATTACH PARTITION {schema}.%I '
                       'FOR VALUES FROM (%s) TO (%s)', 'message_p' || low, low, low + size);
        EXECUTE format('CREATE TABLE {schema}.%I (LIKE {schema}.op_record INCLUDING DEFAULTS '
                       'INCLUDING CONSTRAINTS)', 'op_record_p' || low);
        EXECUTE format('ALTER TABLE {schema}.op_record ATTACH PARTITION {schema}.%I '
                       'FOR VALUES FROM (%s) TO (%s)', 'op_record_p' || low, low, low + size);
        low := low + size;
        made := made + 1;
    END LOOP;
    RETURN made;
END
$body$;

CREATE FUNCTION {schema}.drop_expired_partition(retention_seconds double precision)
RETURNS TABLE (name text, low bigint, high bigint, kept bigint)
LANGUAGE plpgsql {definer} SET lock_timeout = '{LOCK_TIMEOUT}' SET enable_seqscan = off
AS $body$
DECLARE
    candidate record;
    ops text;
    young boolean;
    moved bigint;
BEGIN
    IF NOT {one_pass} THEN
        RETURN;
    END IF;
    LOCK TABLE {schema}.message IN SHARE UPDATE EXCLUSIVE MODE;
    FOR candidate IN
        SELECT b.name, b.low, b.high FROM {schema}.partition_bounds('{schema}.message') AS b
        WHERE b.high <= {next_id} ORDER BY b.high
    LOOP
        -- The BRIN index answers this from block ranges, not rows.
        EXECUTE format('SELECT EXISTS (SELECT FROM {schema}.%I WHERE created_at >= '
                       'now() - make_interval(secs => $1))', candidate.name)
            INTO young USING retention_seconds;
        -- Messages the relay is about to deliver are waited for, not moved (a backlog
        -- would make the move as big as the partition); only stuck ones move.
        IF young OR EXISTS (
            SELECT FROM {schema}.pending AS p
            WHERE p.status = 'PENDING' AND p.resolution = 'COMMIT'
              AND p.message_id >= coalesce(candidate.low, -9223372036854775808)
              AND p.message_id < candidate.high)
        THEN
            RETURN;
        END IF;
        ops := 'op_record_' || substring(candidate.name FROM 9);
        -- The partitions first, without waiting: while autovacuum works on one, waiting
        -- for it here would hold publishers up behind the parent's lock.
        BEGIN
            EXECUTE format('LOCK TABLE {schema}.%I, {schema}.%I IN ACCESS EXCLUSIVE MODE '
                           'NOWAIT', candidate.name, ops);
        EXCEPTION WHEN lock_not_available THEN
            RETURN;
        END;
        EXECUTE format('ALTER TABLE {schema}.message DETACH PARTITION {schema}.%I',
                       candidate.name);
        EXECUTE format('ALTER TABLE {schema}.op_record DETACH PARTITION {schema}.%I', ops);
        -- Unfinished messages (a pending row: parked, discarded, delayed, unknown) move to
        -- the default partition with their op records; the range no longer covers them.
        EXECUTE format('INSERT INTO {schema}.message ({MESSAGE_COLUMNS}) '
                       'SELECT {aliased(MESSAGE_COLUMNS, "m")} '
                       'FROM {schema}.pending AS p JOIN {schema}.%I AS m ON m.id = p.message_id '
                       'WHERE p.message_id >= $1 AND p.message_id < $2', candidate.name)
            USING coalesce(candidate.low, -9223372036854775808), candidate.high;
        GET DIAGNOSTICS moved = ROW_COUNT;
        EXECUTE format('INSERT INTO {schema}.op_record ({OP_RECORD_COLUMNS}) '
                       'SELECT {aliased(OP_RECORD_COLUMNS, "o")} '
                       'FROM {schema}.pending AS p JOIN {schema}.%I AS o '
                       'ON o.message_id = p.message_id '
                       'WHERE p.message_id >= $1 AND p.message_id < $2', ops)
            USING coalesce(candidate.low, -9223372036854775808), candidate.high;
        EXECUTE format('DROP TABLE {schema}.%I, {schema}.%I', candidate.name, ops);
        RETURN QUERY SELECT candidate.name::text, candidate.low::bigint, candidate.high::bigint,
                            moved;
        RETURN;
    END LOOP;
END
$body$;

CREATE FUNCTION {schema}.prune_default(retention_seconds double precision, size integer)
RETURNS TABLE (messages bigint, op_records bigint)
LANGUAGE sql {definer} AS $body$
    WITH expired AS (
        DELETE FROM {schema}.message_default
        WHERE id IN (
            SELECT m.id FROM {schema}.message_default AS m
            WHERE m.created_at < now() - make_interval(secs => retention_seconds)
              AND NOT EXISTS (SELECT FROM {schema}.pending AS p WHERE p.message_id = m.id)
            LIMIT size
            FOR UPDATE SKIP LOCKED
        )
        RETURNING id
    ), history AS (
        DELETE FROM {schema}.op_record_default WHERE message_id IN (SELECT id FROM expired)
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM expired), (SELECT count(*) FROM history)
$body$;

REVOKE ALL ON FUNCTION {schema}.ensure_partitions(bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.drop_expired_partition(double precision) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.prune_default(double precision, integer) FROM PUBLIC;"""


def attach_old_tables(schema: str) -> str:
    """The pre-0006 tables become the first partitions, up to every id handed out so far."""
    return f"""
DO $attach$
DECLARE
    bound bigint;
BEGIN
    SELECT greatest(
        (SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END
         FROM {schema}.message_id_seq),
        (SELECT coalesce(max(id), 0) + 1 FROM {schema}.message_p0),
        (SELECT coalesce(max(message_id), 0) + 1 FROM {schema}.op_record_p0))
    INTO bound;
    EXECUTE format('ALTER TABLE {schema}.message ATTACH PARTITION {schema}.message_p0 '
                   'FOR VALUES FROM (MINVALUE) TO (%s)', bound);
    EXECUTE format('ALTER TABLE {schema}.op_record ATTACH PARTITION {schema}.op_record_p0 '
                   'FOR VALUES FROM (MINVALUE) TO (%s)', bound);
END
$attach$"""


def message_state_view(schema: str) -> str:
    """Revision 0004's view, made again over the new tables (a view holds its tables' oids)."""
    path = Path(__file__).with_name("0004_immutable_messages_pending_queue.py")
    revision_0004 = load_module_py("outbox_revision_0004", path)
    view: str = revision_0004.message_state_view(schema)
    return view


def upgrade() -> None:
    schema = target_schema()
    op.execute(f"DROP VIEW {schema}.message_state")
    for table, indexes in (("message", ("pkey", "created_at_idx")),
                           ("op_record", ("pkey", "message_id_idx", "created_at_idx"))):
        op.execute(f"ALTER TABLE {schema}.{table} RENAME TO {table}_p0")
        for index in indexes:
            op.execute(f"ALTER INDEX {schema}.{table}_{index} RENAME TO {table}_p0_{index}")
        op.execute(f"ALTER SEQUENCE {schema}.{table}_id_seq RENAME TO {table}_p0_id_seq")
    create_message("message", schema, ("id",), postgresql_partition_by="RANGE (id)")
    create_op_record("op_record", schema, ("id", "message_id"),
                     postgresql_partition_by="RANGE (message_id)")
    create_indexes(schema)
    for table in ("message", "op_record"):
        op.execute(f"SELECT setval('{schema}.{table}_id_seq', last_value, is_called) "
                   f"FROM {schema}.{table}_p0_id_seq")
        op.execute(f"ALTER TABLE {schema}.{table}_p0 ALTER COLUMN id DROP IDENTITY")
    op.execute(f"ALTER TABLE {schema}.op_record_p0 DROP CONSTRAINT op_record_p0_pkey")
    op.execute(attach_old_tables(schema))
    for table in ("message", "op_record"):
        op.execute(f"CREATE TABLE {schema}.{table}_default PARTITION OF {schema}.{table} DEFAULT")
    op.execute(partition_functions(schema))
    size = context.config.attributes.get("partition_size", PARTITION_SIZE)
    op.execute(f"SELECT {schema}.ensure_partitions({int(size)}, {AHEAD})")
    op.execute(message_state_view(schema))


def downgrade() -> None:
    """Back to one plain table each: the rows are copied (the partitions then dropped)."""
    schema = target_schema()
    # a publish or delivery committed after the copies would be dropped with the old tables
    op.execute(f"LOCK TABLE {schema}.message, {schema}.op_record, {schema}.pending "
               "IN EXCLUSIVE MODE")
    op.execute(f"DROP VIEW {schema}.message_state")
    for function in FUNCTIONS:
        op.execute(f"DROP FUNCTION {schema}.{function}")
    create_message("message_flat", schema, ("id",))
    create_op_record("op_record_flat", schema, ("id",))
    op.execute(f"INSERT INTO {schema}.message_flat ({MESSAGE_COLUMNS}) "
               f"SELECT {MESSAGE_COLUMNS} FROM {schema}.message")
    op.execute(f"INSERT INTO {schema}.op_record_flat ({OP_RECORD_COLUMNS}) "
               f"SELECT {OP_RECORD_COLUMNS} FROM {schema}.op_record")
    for table in ("message", "op_record"):
        op.execute(f"SELECT setval('{schema}.{table}_flat_id_seq', last_value, is_called) "
                   f"FROM {schema}.{table}_id_seq")
        op.execute(f"DROP TABLE {schema}.{table}")
        op.execute(f"ALTER TABLE {schema}.{table}_flat RENAME TO {table}")
        op.execute(f"ALTER INDEX {schema}.{table}_flat_pkey RENAME TO {table}_pkey")
        op.execute(f"ALTER SEQUENCE {schema}.{table}_flat_id_seq RENAME TO {table}_id_seq")
    create_indexes(schema)
    op.execute(message_state_view(schema))
