"""The outbox tables as SQLAlchemy Core metadata: the one source of truth for their shape.

Tables are declared in the default schema ``outbox``; another schema is reached with
``schema_translate_map`` (see :func:`translate`) so the metadata stays a single object.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    false,
    func,
    text,
    true,
)

DEFAULT_SCHEMA = "outbox"
#: Keys are hashed into this many virtual shards; a relay owns a shard through a lease.
SHARDS = 64
VERSION_TABLE = "outbox_alembic_version"
#: The hot tables' columns whose values have rules, and the domain each is typed with
#: (revision 0016), over the type declared below: PostgreSQL reads a domain's constraints once
#: per session, a table's CHECK constraints for every statement that writes the table. The
#: rules: a shard a relay can own (0 to SHARDS - 1), none of the headers the relay adds itself
#: (content-type, outbox-id) among the header keys, an unfinished status, an open resolution,
#: an op record's action.
DOMAINS = {("message", "shard"): "shard", ("message", "header_keys"): "header_keys",
           ("pending", "shard"): "shard", ("pending", "status"): "pending_status",
           ("pending", "resolution"): "pending_resolution", ("op_record", "action"): "op_action"}


class Resolution(StrEnum):
    """Outcome of the transaction that wrote a prepare row (RocketMQ LocalTransactionState)."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    UNKNOWN = "UNKNOWN"


class Status(StrEnum):
    """Where a prepare row is in its life (DELIVERED and ROLLED_BACK: its last op record)."""

    PENDING = "PENDING"
    DELAYED = "DELAYED"
    DELIVERED = "DELIVERED"
    ROLLED_BACK = "ROLLED_BACK"
    PARKED = "PARKED"
    DISCARDED = "DISCARDED"


class Action(StrEnum):
    """What an op record says was done to a prepare row."""

    DELIVERED = "DELIVERED"
    ROLLED_BACK = "ROLLED_BACK"
    PARKED = "PARKED"
    DISCARDED = "DISCARDED"
    RESUMED = "RESUMED"


def one_of(column: str, enum: type[StrEnum], exclude: tuple[StrEnum, ...] = ()) -> CheckConstraint:
    values = ", ".join(f"'{member.value}'" for member in enum if member not in exclude)
    return CheckConstraint(f"{column} IN ({values})", name=f"{column}_valid")


metadata = MetaData(
    schema=DEFAULT_SCHEMA,
    naming_convention={
        "pk": "%(table_name)s_pkey",
        "ck": "%(table_name)s_%(constraint_name)s",
        "ix": "%(table_name)s_%(column_0_name)s_idx",
    },
)

#: Prepare rows (RocketMQ's half messages), written once in the application's transaction and
#: never updated: what a row is waiting for lives in ``pending``, what was done to it in
#: ``op_record``. Partitioned by ranges of id (revision 0006), so retention drops partitions.
message = Table(
    "message",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("producer_group", Text, nullable=False, server_default="default"),
    Column("topic", Text, nullable=False),
    Column("key", LargeBinary),
    Column("header_keys", ARRAY(Text)),
    Column("header_values", ARRAY(LargeBinary)),
    Column("payload", LargeBinary, nullable=False),
    Column("content_type", Text, nullable=False),
    Column("shard", SmallInteger, nullable=False),
    Column("deliver_after", DateTime(timezone=True)),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("message_created_at_idx", "created_at", postgresql_using="brin"),
    postgresql_partition_by="RANGE (id)",
)

#: The narrow, churning state of every message not yet finished: inserted by the publish
#: statement, deleted (with its DELIVERED or ROLLED_BACK op record) when the row is done, so
#: a delivery never rewrites the message row. PARKED and DISCARDED rows stay until resumed.
pending = Table(
    "pending",
    metadata,
    Column("message_id", BigInteger, primary_key=True, autoincrement=False),
    Column("shard", SmallInteger, nullable=False),
    Column("topic", Text, nullable=False),
    Column("key", LargeBinary),
    Column("producer_group", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("resolution", Text, nullable=False),
    Column("deliver_after", DateTime(timezone=True)),
    Column("next_check_at", DateTime(timezone=True)),
    Column("check_count", Integer, nullable=False, server_default="0"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", Text),
    Column("created_at", DateTime(timezone=True), nullable=False),
    # A held topic's waiting row, out of the fetch's walk (relay/holds.py, revision 0024).
    Column("held", Boolean, nullable=False, server_default=false()),
    Index(
        "pending_relay_idx",
        "message_id",
        postgresql_where=text("status = 'PENDING' AND resolution = 'COMMIT' AND NOT held"),
    ),
    # The sweeper's due rows, group by group (revision 0026: groups take turns).
    Index(
        "pending_check_idx",
        "producer_group",
        "next_check_at",
        postgresql_where=text("resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')"),
    ),
    # Rows that hold back later rows of their key: delayed, awaiting their resolution, or held;
    # the key by its first 2,048 bytes (B-tree entries are capped at 2,704 bytes).
    Index(
        "pending_hold_idx",
        "topic",
        text("substr(key, 1, 2048)"),
        "message_id",
        postgresql_where=text(
            "key IS NOT NULL AND (status = 'DELAYED' "
            "OR (status = 'PENDING' AND resolution = 'UNKNOWN') OR held)"
        ),
    ),
    Index("pending_held_idx", "topic", "shard", "message_id", postgresql_where=text("held")),
    Index("pending_delayed_idx", "deliver_after", postgresql_where=text("status = 'DELAYED'")),
)

#: Op records (RocketMQ's op messages): one per thing done to a prepare row, partitioned by
#: ``message_id`` with the message's bounds, so they are dropped with their message.
op_record = Table(
    "op_record",
    metadata,
    Column("id", BigInteger, Identity(always=False), nullable=False),
    Column("message_id", BigInteger, nullable=False),
    Column("action", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("kafka_partition", Integer),
    Column("kafka_offset", BigInteger),
    Column("detail", Text),
    # a message's op records are what every reader looks up (revision 0017)
    PrimaryKeyConstraint("message_id", "id", name="op_record_pkey"),
    Index("op_record_created_at_idx", "created_at", postgresql_using="brin"),
    postgresql_partition_by="RANGE (message_id)",
)

#: Producer groups bound to a role: only its members may decide the group's UNKNOWN messages
#: (written by the operator; a group not listed may be decided by any application role).
producer_group_role = Table(
    "producer_group_role",
    metadata,
    Column("producer_group", Text, primary_key=True),
    Column("role", Text, nullable=False),
)

#: One row per virtual shard: which relay delivers that shard's messages, and until when;
#: whether its last owner handed it back with every send recorded (``clean``), and since when
#: its sends may be unrecorded (``settled_at``): what a new owner needs to skip or bound the
#: tail read of relay/recovery.py.
relay_lease = Table(
    "relay_lease",
    metadata,
    Column("shard", SmallInteger, primary_key=True, autoincrement=False),
    Column("owner", Text),
    Column("expires_at", DateTime(timezone=True)),
    Column("clean", Boolean, nullable=False, server_default=true()),
    Column("settled_at", DateTime(timezone=True)),
)

#: Live relays announce themselves here so each can take a fair share of the shards.
relay_member = Table(
    "relay_member",
    metadata,
    Column("worker_id", Text, primary_key=True),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("in_flight", Integer, nullable=False, server_default="0"),
    #: while the relay cannot deliver (PostgreSQL or Kafka away): since when, and why
    Column("paused_since", DateTime(timezone=True)),
    Column("paused_reason", Text),
)


def translate(schema: str) -> dict[str | None, str]:
    """The ``schema_translate_map`` that points the metadata at ``schema``."""
    return {DEFAULT_SCHEMA: schema}
