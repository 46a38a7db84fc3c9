"""The only module that speaks the outbox's SQL (``sql/queries.sql``).

Each function takes a SQLAlchemy ``Connection`` (or returns a statement for the caller's
session to run), so the library, the relay and the CLI share one set of queries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any

from sqlalchemy import Connection, TextClause, text

from outbox.message import EncodedMessage
from outbox.schema import Resolution
from outbox.settings import validate_identifier

#: Namespace of the advisory locks that order writers of one key (first half of the lock key).
LOCK_CLASS = 0x0B0C
_BLOCK = re.compile(r"^-- name: (\w+)\n", re.MULTILINE)


@cache
def _raw_queries() -> dict[str, str]:
    source = resources.files("outbox").joinpath("sql/queries.sql").read_text()
    parts = _BLOCK.split(source)[1:]
    return {name: body.strip() for name, body in zip(parts[::2], parts[1::2], strict=True)}


@cache
def query(name: str, schema: str) -> TextClause:
    """The named query, bound to ``schema`` (a validated identifier, never raw input)."""
    return text(_raw_queries()[name].replace("{schema}", validate_identifier(schema)))


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which commits of new prepare rows are announced."""
    return f"{validate_identifier(schema)}_pending"


def publish(
    schema: str,
    message: EncodedMessage,
    *,
    producer_group: str = "default",
    resolution: Resolution = Resolution.COMMIT,
    deliver_at: datetime | None = None,
    delay_seconds: float = 0.0,
    check_after_seconds: float | None = None,
) -> tuple[TextClause, dict[str, Any]]:
    """The statement and parameters that write one prepare row (run by the caller).

    ``deliver_at`` or ``delay_seconds`` (from the database's now) holds a message back;
    ``check_after_seconds`` is when an UNKNOWN row is first checked back.
    """
    return query("publish", schema), {
        "producer_group": producer_group,
        "topic": message.topic,
        "key": message.key,
        "header_keys": message.header_keys,
        "header_values": message.header_values,
        "payload": message.payload,
        "content_type": message.content_type,
        "resolution": resolution.value,
        "shard": message.shard,
        "check_after_seconds": check_after_seconds,
        "deliver_at": deliver_at,
        "delay_seconds": delay_seconds,
        "lock_class": LOCK_CLASS,
        "lock_key": message.lock_key,
        "channel": notify_channel(schema),
    }


@dataclass(frozen=True, slots=True)
class Deliverable:
    """A committed prepare row as the relay sends it."""

    id: int
    topic: str
    key: bytes | None
    headers: list[tuple[str, bytes]]
    payload: bytes
    content_type: str
    created_at: datetime


def fetch_deliverable(
    conn: Connection, schema: str, shards: Iterable[int], limit: int
) -> list[Deliverable]:
    rows = conn.execute(
        query("fetch_deliverable", schema), {"shards": list(shards), "limit": limit}
    )
    return [
        Deliverable(
            id=row.id,
            topic=row.topic,
            key=row.key,
            headers=list(zip(row.header_keys or (), row.header_values or (), strict=True)),
            payload=row.payload,
            content_type=row.content_type,
            created_at=row.created_at,
        )
        for row in rows
    ]


def promote_due(
    conn: Connection, schema: str, shards: Iterable[int]
) -> tuple[int, float | None]:
    """Make due DELAYED rows deliverable; returns (how many, seconds until the next is due)."""
    row = conn.execute(query("promote_due", schema), {"shards": list(shards)}).one()
    return int(row.promoted), None if row.next_due_in is None else float(row.next_due_in)


def resume(conn: Connection, schema: str, actor: str, ids: Sequence[int] = (),
           *, resume_all: bool = False) -> list[tuple[int, str]]:
    """Re-queue PARKED and re-arm DISCARDED rows; returns (id, what it was) for each."""
    rows = conn.execute(
        query("resume", schema),
        {"ids": list(ids), "all": resume_all, "actor": actor, "channel": notify_channel(schema)},
    )
    return [(row.message_id, row.detail.removeprefix("was ")) for row in rows]


def mark_delivered(
    conn: Connection,
    schema: str,
    actor: str,
    acks: Sequence[tuple[int, int, int]],
) -> None:
    """Record ``(message id, partition, offset)`` acknowledgements as op records."""
    if not acks:
        return
    ids, partitions, offsets = (list(column) for column in zip(*acks, strict=True))
    conn.execute(
        query("mark_delivered", schema),
        {"ids": ids, "partitions": partitions, "offsets": offsets, "actor": actor},
    )


def record_failure(conn: Connection, schema: str, ids: Sequence[int], error: str) -> None:
    if ids:
        conn.execute(query("record_failure", schema), {"ids": list(ids), "error": error})


def heartbeat(conn: Connection, schema: str, worker_id: str, lease_seconds: float) -> int:
    """Announce this relay and return how many relays are alive."""
    params = {"worker_id": worker_id, "lease_seconds": lease_seconds}
    conn.execute(query("heartbeat", schema), params)
    return int(conn.execute(query("live_relays", schema), params).scalar_one())


def renew_leases(conn: Connection, schema: str, worker_id: str, lease_seconds: float) -> set[int]:
    rows = conn.execute(
        query("renew_leases", schema), {"worker_id": worker_id, "lease_seconds": lease_seconds}
    )
    return {row.shard for row in rows}


def claim_leases(
    conn: Connection, schema: str, worker_id: str, lease_seconds: float, wanted: int
) -> set[int]:
    rows = conn.execute(
        query("claim_leases", schema),
        {"worker_id": worker_id, "lease_seconds": lease_seconds, "wanted": wanted},
    )
    return {row.shard for row in rows}


def release_leases(conn: Connection, schema: str, worker_id: str, shards: Sequence[int]) -> None:
    conn.execute(
        query("release_leases", schema), {"worker_id": worker_id, "shards": list(shards)}
    )


def leave(conn: Connection, schema: str, worker_id: str) -> None:
    conn.execute(query("leave", schema), {"worker_id": worker_id})


def schema_version(conn: Connection, schema: str) -> str | None:
    """The applied migration revision, or None when the schema was never migrated."""
    table = f"{validate_identifier(schema)}.outbox_alembic_version"
    if not conn.execute(query("table_exists", schema), {"table": table}).scalar_one():
        return None
    return conn.execute(query("schema_version", schema)).scalar_one_or_none()
