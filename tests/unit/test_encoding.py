"""What ``publish`` makes of its arguments: the prepare row's bytes, shard and lock key."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime, timedelta

import pytest

from outbox import InvalidMessage
from outbox.encoding import (
    BINARY,
    JSON,
    TEXT,
    EncodedMessage,
    delivery_time,
    encode,
    encode_headers,
    encode_key,
    encode_payload,
    key_hash,
    merged_headers,
)
from outbox.schema import SHARDS


def test_keys_are_bytes_and_none_stays_none() -> None:
    assert encode_key("clé") == "clé".encode()
    assert encode_key(b"\x00k") == b"\x00k"
    assert encode_key(None) is None


def test_headers_become_parallel_name_and_byte_lists() -> None:
    assert encode_headers({"trace": "abc", "raw": b"\xff"}) == (["trace", "raw"],
                                                                 [b"abc", b"\xff"])
    assert encode_headers({}) == (None, None)
    assert encode_headers(None) == (None, None)


def test_reserved_headers_are_refused_whatever_their_case() -> None:
    with pytest.raises(InvalidMessage, match="set by the outbox itself"):
        encode_headers({"Content-Type": "text/plain"})


@pytest.mark.parametrize(
    ("payload", "body", "content_type"),
    [
        (b"\x00\x01", b"\x00\x01", BINARY),
        (bytearray(b"ab"), b"ab", BINARY),
        (memoryview(b"cd"), b"cd", BINARY),
        ("héllo", "héllo".encode(), TEXT),
        ({"b": [1, 2], "é": None}, '{"b":[1,2],"é":null}'.encode(), JSON),
        (7, b"7", JSON),
        (None, b"null", JSON),  # not a tombstone (docs/api.md)
    ],
)
def test_payloads_are_encoded_by_type(payload: object, body: bytes, content_type: str) -> None:
    assert encode_payload(payload) == (body, content_type)


def test_delivery_time_is_a_delay_or_an_instant() -> None:
    at = datetime(2026, 11, 22, 8, tzinfo=UTC)
    assert delivery_time(None, None) == {}
    assert delivery_time(timedelta(minutes=2), None) == {"delay_seconds": 120.0}
    assert delivery_time(None, at) == {"deliver_at": at}


@pytest.mark.parametrize(
    ("after", "at", "error"),
    [
        (timedelta(seconds=1), datetime(2026, 1, 1, tzinfo=UTC), "not both"),
        (timedelta(seconds=-1), None, "timedelta of zero or more"),
        (5, None, "timedelta of zero or more"),
        (None, datetime(2026, 1, 1), "timezone-aware datetime"),
        (None, "2026-01-01T00:00:00Z", "timezone-aware datetime"),
    ],
)
def test_bad_delivery_times_are_rejected(after: object, at: object, error: str) -> None:
    with pytest.raises(InvalidMessage, match=error):
        delivery_time(after, at)  # type: ignore[arg-type]


def test_key_hash_is_a_stable_crc_of_topic_and_key() -> None:
    assert key_hash("orders", b"k1") == zlib.crc32(b"k1", zlib.crc32(b"orders\0"))
    assert key_hash("orders", b"k1") != key_hash("orders2", b"k1")
    assert key_hash("orders", b"k1") != key_hash("orders", b"k2")


def encoded(payload: object = "p", *, key: str | None = None, content_type: str | None = None,
            random_shard: int = 0) -> EncodedMessage:
    return encode("orders", payload, key=key, headers=None, content_type=content_type,
                  max_payload_bytes=100, random_shard=random_shard)


def test_keyed_messages_get_the_keys_shard_and_a_signed_lock_key() -> None:
    keys = [f"k{n}" for n in range(200)]
    messages = [encoded(key=key) for key in keys]
    for key, message in zip(keys, messages, strict=True):
        hashed = key_hash("orders", key.encode())
        assert message.shard == hashed % SHARDS
        assert message.lock_key % (1 << 32) == hashed
        assert -(1 << 31) <= message.lock_key < 1 << 31
    assert encoded(key="k7") == encoded(key="k7")


def test_keyless_messages_are_placed_by_the_random_shard_and_take_no_lock() -> None:
    message = encoded(random_shard=SHARDS + 5)
    assert (message.shard, message.lock_key, message.key) == (5, None, None)


def test_the_payload_limit_is_inclusive_and_an_explicit_content_type_wins() -> None:
    assert encoded(b"x" * 100).content_type == "application/octet-stream"
    with pytest.raises(InvalidMessage, match="payload is 101 bytes, over the maximum of 100"):
        encoded(b"x" * 101)
    # an explicit content type is sent as a header, and counts as one
    message = encoded(b"x" * 85, content_type="application/xml")
    assert message.content_type == "application/xml"
    with pytest.raises(InvalidMessage, match=r"message is 101 bytes .* content type 15"):
        encoded(b"x" * 86, content_type="application/xml")


def test_the_callers_header_wins_over_the_outboxs_whatever_the_case_of_its_name() -> None:
    """Both ``traceparent`` and the caller's ``TraceParent`` were stored and sent."""
    ours = {"traceparent": "00-ours", "ce_id": "1"}
    assert merged_headers(ours, {"TraceParent": "00-theirs"}) == {
        "ce_id": "1", "TraceParent": "00-theirs"}
    assert merged_headers(ours, None) == ours
