"""Turning what an application passes to ``publish`` into a prepare row, or a clear error."""

from __future__ import annotations

import json
import re
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox.exceptions import InvalidMessage
from outbox.schema import SHARDS
from outbox.tracing import trace_headers

TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: Header the relay adds to every record: the prepare row's id, for consumer deduplication.
ID_HEADER = "outbox-id"
#: Message ids are PostgreSQL bigints from a sequence starting at 1.
MAX_MESSAGE_ID = 2**63 - 1
CONTENT_TYPE_HEADER = "content-type"
RESERVED_HEADERS = frozenset({ID_HEADER, CONTENT_TYPE_HEADER})

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
BINARY = "application/octet-stream"


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is a whole number in ASCII digits: ``str.isdigit`` also takes ``²``
    (which ``int()`` refuses) and Arabic-Indic or full-width digits (which it reads)."""
    return text.isascii() and text.isdigit()


def header_message_id(value: str | bytes | None) -> int | None:
    """An ``outbox-id`` header's message id; None for a value no relay writes (another
    producer's header of the same name): ``int()`` of it, or a bigint column of it, ended
    whatever read the topic, and the next reader read the same record."""
    if not value:
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if not ascii_digits(text) or len(text) > 19:
        return None
    message_id = int(text)
    return message_id if 0 < message_id <= MAX_MESSAGE_ID else None


@dataclass(frozen=True, slots=True)
class EncodedMessage:
    """A validated message, ready to be written as a prepare row."""

    topic: str
    key: bytes | None
    header_keys: list[str] | None
    header_values: list[bytes] | None
    payload: bytes
    content_type: str
    shard: int
    #: Advisory-lock key serialising writers of one (topic, key); None for keyless messages.
    lock_key: int | None


def validate_topic(topic: object) -> str:
    if not isinstance(topic, str) or not TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise InvalidMessage(
            f"invalid Kafka topic name {topic!r}: use 1-249 characters from [a-zA-Z0-9._-], "
            "and not '.' or '..'"
        )
    return topic


#: Control characters: no header name or content type may hold them (NUL cannot even be
#: stored in PostgreSQL text; CR/LF would let a value forge headers in HTTP/CloudEvents bridges).
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8, or one line saying which input holds a lone surrogate."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            f"{what} is not valid UTF-8 text (a lone surrogate at position {exc.start}); "
            "fix the text or pass bytes") from None


def validate_name(value: object, what: str) -> str:
    """A non-empty str of valid text without control characters (header names, content type)."""
    if not isinstance(value, str) or not value or CONTROL.search(value):
        raise InvalidMessage(
            f"{what} {value!r} must be a non-empty str without control characters")
    utf8(value, what)
    return value


def encode_key(key: object) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return utf8(key, "key")
    raise InvalidMessage(f"message key must be str, bytes or None, got {type(key).__name__}")


def encode_headers(headers: object) -> tuple[list[str] | None, list[bytes] | None]:
    if headers is None:
        return None, None
    if not isinstance(headers, Mapping):
        raise InvalidMessage(
            f"headers must be a mapping of str to str or bytes, got {type(headers).__name__}"
        )
    keys: list[str] = []
    values: list[bytes] = []
    for name, value in headers.items():
        if not isinstance(name, str):
            raise InvalidMessage(f"header name {name!r} must be a str")
        validate_name(name, "header name")
        if name.lower() in RESERVED_HEADERS:
            raise InvalidMessage(f"header {name!r} is set by the outbox itself; use another name")
        if isinstance(value, str):
            if CONTROL.search(value):
                raise InvalidMessage(f"header {name!r} has control characters (CR, LF, NUL...) "
                                     "in its text; pass bytes for a binary value")
            value = utf8(value, f"header {name!r}")
        elif not isinstance(value, bytes):
            raise InvalidMessage(
                f"header {name!r} must be str or bytes, got {type(value).__name__}"
            )
        keys.append(name)
        values.append(value)
    return (keys, values) if keys else (None, None)


def encode_payload(payload: object) -> tuple[bytes, str]:
    """Bytes pass through, str is UTF-8, anything else is JSON."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), BINARY
    if isinstance(payload, str):
        return utf8(payload, "payload"), TEXT
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(
            f"payload of type {type(payload).__name__} is not JSON-serialisable ({exc}); "
            "pass bytes, str, or JSON-compatible data"
        ) from None
    return utf8(text, "payload"), JSON


def cloudevent_headers(event_type: str, source: str | None) -> dict[str, str]:
    """The CloudEvents Kafka binding's binary-mode attributes (``content-type`` is the
    outbox's own header, which the binding reads as ``datacontenttype``)."""
    if not source:
        raise InvalidMessage(
            "a CloudEvent needs a source: pass cloudevent_source= or "
            "Outbox(cloudevents_source=...)"
        )
    return {
        "ce_specversion": "1.0",
        "ce_id": str(uuid.uuid4()),
        "ce_source": source,
        "ce_type": event_type,
        "ce_time": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }


#: The longest a message may be held back by default (``OUTBOX_MAX_DELAY``): 30 days.
DEFAULT_MAX_DELAY = 30 * 86400.0


def delivery_time(
    deliver_after: timedelta | None, deliver_at: datetime | None,
    max_delay: float = DEFAULT_MAX_DELAY,
) -> dict[str, Any]:
    """The publish parameters for a delayed message (none for an immediate one). A delay
    beyond ``max_delay`` seconds is refused: it would hold its key back that long."""
    if deliver_after is not None and deliver_at is not None:
        raise InvalidMessage("pass deliver_after or deliver_at, not both")
    longest = timedelta(seconds=max_delay)
    if deliver_after is not None:
        if not isinstance(deliver_after, timedelta) or deliver_after < timedelta(0):
            raise InvalidMessage(
                f"deliver_after must be a timedelta of zero or more, got {deliver_after!r}"
            )
        if deliver_after > longest:
            raise InvalidMessage(f"deliver_after {deliver_after} is longer than max_delay "
                                 f"({longest}); raise OUTBOX_MAX_DELAY to delay longer")
        return {"delay_seconds": deliver_after.total_seconds()}
    if deliver_at is not None:
        if not isinstance(deliver_at, datetime) or deliver_at.utcoffset() is None:
            raise InvalidMessage(
                f"deliver_at must be a timezone-aware datetime, got {deliver_at!r}"
            )
        if deliver_at - datetime.now(UTC) > longest:
            raise InvalidMessage(f"deliver_at {deliver_at.isoformat()} is further ahead than "
                                 f"max_delay ({longest}); raise OUTBOX_MAX_DELAY to delay longer")
        return {"deliver_at": deliver_at}
    return {}


def key_hash(topic: str, key: bytes) -> int:
    """A stable 32-bit hash of (topic, key), the same in every process."""
    return zlib.crc32(key, zlib.crc32(topic.encode() + b"\0"))


def _check_size(body: bytes, key: bytes | None, header_keys: list[str] | None,
                header_values: list[bytes] | None, content_type: str | None,
                limit: int) -> None:
    """The whole record counts: key, headers and an explicit content type (sent as a
    header), not only the payload."""
    extra = len(key or b"") + sum(len(name.encode()) for name in header_keys or ()) + sum(
        len(value) for value in header_values or ()) + len((content_type or "").encode())
    if len(body) + extra <= limit:
        return
    size = (f"payload is {len(body)} bytes" if not extra else
            f"message is {len(body) + extra} bytes (payload {len(body)}, key, headers and "
            f"content type {extra})")
    raise InvalidMessage(
        f"{size}, over the maximum of {limit}; store large data elsewhere and publish a "
        "reference, or raise max_payload_bytes")


def merged_headers(ours: dict[str, str], theirs: Any) -> Any:
    """The outbox's headers (trace context, CloudEvents attributes) under the caller's, which
    win, whatever the case of their names (``TraceParent`` replaces ``traceparent``); the
    caller's are checked to be a mapping first."""
    if theirs is not None and not isinstance(theirs, Mapping):
        return theirs  # encode_headers refuses it, as it would without ours
    named = {name.lower() for name in theirs or () if isinstance(name, str)}
    return {**{name: value for name, value in ours.items() if name.lower() not in named},
            **(theirs or {})}


def encode(
    topic: str,
    payload: Any,
    *,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    content_type: str | None,
    max_payload_bytes: int,
    random_shard: int,
) -> EncodedMessage:
    """Validate and encode one message; ``random_shard`` places keyless messages."""
    topic = validate_topic(topic)
    raw_key = encode_key(key)
    traced = trace_headers()
    header_keys, header_values = encode_headers(merged_headers(traced, headers)
                                                if traced else headers)
    body, detected = encode_payload(payload)
    if content_type is not None:
        validate_name(content_type, "content_type")
    _check_size(body, raw_key, header_keys, header_values, content_type, max_payload_bytes)
    if raw_key is None:
        shard, lock_key = random_shard % SHARDS, None
    else:
        hashed = key_hash(topic, raw_key)
        shard, lock_key = hashed % SHARDS, hashed - (1 << 32) if hashed >= 1 << 31 else hashed
    return EncodedMessage(
        topic=topic,
        key=raw_key,
        header_keys=header_keys,
        header_values=header_values,
        payload=body,
        content_type=content_type or detected,
        shard=shard,
        lock_key=lock_key,
    )
