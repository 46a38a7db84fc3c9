"""``Outbox``: the front door applications hold to publish messages transactionally."""

from __future__ import annotations

import random
from collections.abc import Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, overload

from sqlalchemy import Connection, TextClause
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import store
from outbox.exceptions import ConfigurationError, NotInTransaction
from outbox.message import delivery_time, encode
from outbox.settings import Settings, load_settings

SyncTarget = Session | Connection
AsyncTarget = AsyncSession | AsyncConnection


class Outbox:
    """Writes prepare rows in the caller's transaction; the relay delivers them once committed.

    ``Outbox()`` reads ``OUTBOX_*`` environment variables; keyword arguments override them.
    """

    def __init__(
        self,
        *,
        schema: str | None = None,
        max_payload_bytes: int | None = None,
        producer_group: str = "default",
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or load_settings(
            schema=schema, max_payload_bytes=max_payload_bytes
        )
        self.schema = self.settings.schema_name
        self.producer_group = producer_group
        self._random = random.Random()

    @overload
    def publish(
        self,
        session: SyncTarget,
        topic: str,
        payload: Any,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        content_type: str | None = None,
        deliver_after: timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> int: ...

    @overload
    def publish(
        self,
        session: AsyncTarget,
        topic: str,
        payload: Any,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        content_type: str | None = None,
        deliver_after: timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> Coroutine[Any, Any, int]: ...

    def publish(
        self,
        session: SyncTarget | AsyncTarget,
        topic: str,
        payload: Any,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        content_type: str | None = None,
        deliver_after: timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> int | Coroutine[Any, Any, int]:
        """Write a prepare row for ``payload`` inside ``session``'s open transaction.

        Returns the message id; with an async session or connection, returns an awaitable.
        The message is delivered to ``topic`` only if the transaction commits; messages with
        the same ``key`` keep their order. Payloads: bytes, str, or JSON-serialisable data.
        ``deliver_after`` / ``deliver_at`` hold it back until then (later messages of the
        same key wait behind it).
        """
        message = encode(
            topic,
            payload,
            key=key,
            headers=headers,
            content_type=content_type,
            max_payload_bytes=self.settings.max_payload_bytes,
            random_shard=self._random.getrandbits(16),
        )
        statement, params = store.publish(
            self.schema,
            message,
            producer_group=self.producer_group,
            **delivery_time(deliver_after, deliver_at),
        )
        if isinstance(session, AsyncSession | AsyncConnection):
            return self._execute_async(session, statement, params)
        _require_transaction(session.in_transaction(), _connection_of(session))
        return int(session.execute(statement, params).scalar_one())

    async def _execute_async(
        self, session: AsyncTarget, statement: TextClause, params: dict[str, Any]
    ) -> int:
        in_transaction = session.in_transaction()
        connection = await session.connection() if isinstance(session, AsyncSession) else session
        _require_transaction(in_transaction, connection.sync_connection)
        result = await session.execute(statement, params)
        return int(result.scalar_one())


def _connection_of(session: SyncTarget) -> Connection | None:
    if isinstance(session, Session):
        return session.connection() if session.in_transaction() else None
    return session


def _require_transaction(in_transaction: bool, connection: Connection | None) -> None:
    """Refuse to publish where the row would not share the business transaction's fate."""
    if connection is not None and connection.dialect.name != "postgresql":
        raise ConfigurationError(
            f"the outbox needs PostgreSQL, but this session uses {connection.dialect.name}"
        )
    autocommit = connection is not None and bool(
        getattr(connection.connection.driver_connection, "autocommit", False)
    )
    if not in_transaction or autocommit:
        raise NotInTransaction(
            "publish() needs an open transaction so the message commits or rolls back with "
            "your data: call it inside `with session.begin():` (or `async with ...`), "
            "not in autocommit mode"
        )
