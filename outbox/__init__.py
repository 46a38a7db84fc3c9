"""Transactional outbox on PostgreSQL: publish inside your transaction, the relay delivers."""

from outbox.app import Outbox
from outbox.exceptions import (
    ConfigurationError,
    InvalidMessage,
    NotInTransaction,
    OutboxError,
    SchemaNotMigrated,
    ServiceUnavailable,
)
from outbox.schema import Resolution, Status
from outbox.settings import Settings

__all__ = [
    "ConfigurationError",
    "InvalidMessage",
    "NotInTransaction",
    "Outbox",
    "OutboxError",
    "Resolution",
    "SchemaNotMigrated",
    "ServiceUnavailable",
    "Settings",
    "Status",
]
