"""Transactional outbox on PostgreSQL: publish inside your transaction, the relay delivers."""

from outbox.app import Outbox
from outbox.exceptions import (
    ConfigurationError,
    DecisionConflict,
    InvalidMessage,
    MessageNotFound,
    NotInTransaction,
    OutboxError,
    SchemaNotMigrated,
    ServiceUnavailable,
)
from outbox.message import Message, TransactionResult
from outbox.schema import Resolution, Status
from outbox.settings import Settings

__all__ = [
    "ConfigurationError",
    "DecisionConflict",
    "InvalidMessage",
    "Message",
    "MessageNotFound",
    "NotInTransaction",
    "Outbox",
    "OutboxError",
    "Resolution",
    "SchemaNotMigrated",
    "ServiceUnavailable",
    "Settings",
    "Status",
    "TransactionResult",
]
