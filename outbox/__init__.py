"""Transactional outbox on PostgreSQL: publish inside your transaction, the relay delivers.

The names below are imported on first use, so a process that needs one module of the
package (a Spark worker reading a topic, a checker) does not pay for all of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for type checkers (`X as X`: a re-export)
    from outbox.app import Outbox as Outbox
    from outbox.exceptions import ConfigurationError as ConfigurationError
    from outbox.exceptions import DecisionConflict as DecisionConflict
    from outbox.exceptions import InvalidMessage as InvalidMessage
    from outbox.exceptions import MessageNotFound as MessageNotFound
    from outbox.exceptions import NotAwaited as NotAwaited
    from outbox.exceptions import NotInTransaction as NotInTransaction
    from outbox.exceptions import OutboxError as OutboxError
    from outbox.exceptions import SchemaNotMigrated as SchemaNotMigrated
    from outbox.exceptions import ServiceUnavailable as ServiceUnavailable
    from outbox.message import Message as Message
    from outbox.message import TransactionResult as TransactionResult
    from outbox.schema import Resolution as Resolution
    from outbox.schema import Status as Status
    from outbox.settings import Settings as Settings

#: Each public name and the module that defines it.
_HOMES = {
    "ConfigurationError": "outbox.exceptions",
    "DecisionConflict": "outbox.exceptions",
    "InvalidMessage": "outbox.exceptions",
    "Message": "outbox.message",
    "MessageNotFound": "outbox.exceptions",
    "NotAwaited": "outbox.exceptions",
    "NotInTransaction": "outbox.exceptions",
    "Outbox": "outbox.app",
    "OutboxError": "outbox.exceptions",
    "Resolution": "outbox.schema",
    "SchemaNotMigrated": "outbox.exceptions",
    "ServiceUnavailable": "outbox.exceptions",
    "Settings": "outbox.settings",
    "Status": "outbox.schema",
    "TransactionResult": "outbox.message",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
