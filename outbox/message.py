"""The public types a local transaction, a checker or a caller of ``send_in_transaction`` sees."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypedDict

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


class PublishOptions(TypedDict, total=False):
    """The keyword options of ``publish`` (and of ``prepare`` and ``send_in_transaction``)."""

    #: Messages with the same key keep their order (and land on one partition).
    key: str | bytes | None
    headers: Mapping[str, str | bytes] | None
    #: Default: detected from the payload (JSON, text or bytes).
    content_type: str | None
    #: Hold the message back this long (later messages of its key wait behind it).
    deliver_after: timedelta | None
    #: Or until this time (timezone-aware).
    deliver_at: datetime | None
    #: Send as a CloudEvent of this ``ce_type`` (default: the topic, when the outbox has a
    #: ``cloudevents_source``).
    cloudevent_type: str | None
    #: Send as a CloudEvent from this ``ce_source`` (default: the outbox's).
    cloudevent_source: str | None


class PrepareOptions(PublishOptions, total=False):
    """``PublishOptions`` and, for a half message, when it is first checked back."""

    check_immunity: timedelta | None
