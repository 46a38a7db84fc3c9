"""The public types a local transaction, a checker or a caller of ``send_in_transaction`` sees."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from outbox.schema import Resolution


@dataclass(frozen=True, slots=True)
class Message:
    """A prepare row as a local transaction or a checker sees it."""

    id: int
    producer_group: str
    topic: str
    key: bytes | None
    headers: dict[str, bytes]
    payload: bytes
    content_type: str
    #: Check-backs already made (0 for the local transaction and the first check).
    check_count: int = 0

    def json(self) -> Any:
        """The payload decoded as JSON (what ``publish`` stores for non-bytes payloads)."""
        return json.loads(self.payload)


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """What ``send_in_transaction`` recorded (RocketMQ's TransactionSendResult)."""

    message_id: int
    resolution: Resolution
