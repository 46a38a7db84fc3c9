"""Publish inputs that used to escape InvalidMessage (a multi-line driver error that aborted
the caller's transaction) are refused with one line before any statement is sent."""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime, timedelta, tzinfo

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import ConfigurationError, InvalidMessage, Outbox
from outbox.settings import PublishSettings, RelaySettings
from tests.unit.test_publish_validation import publish_and_commit

NOW = datetime.now(UTC)


class NoOffset(tzinfo):
    """A tzinfo that knows no offset: the datetime is naive for all purposes."""

    def utcoffset(self, _dt: datetime | None) -> None:
        return None


def nested(depth: int) -> list[object]:
    payload: list[object] = []
    for _ in range(depth):
        payload = [payload]
    return payload


@pytest.fixture
def outbox() -> Outbox:
    return Outbox(settings=PublishSettings(database_url="postgresql://app@nowhere/shop",
                                           max_payload_bytes=1000))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"payload": "\ud800"}, "payload is not valid UTF-8 text"),
        ({"payload": {"a": "\udcff"}}, "payload is not valid UTF-8 text"),
        ({"key": "\ud800"}, "key is not valid UTF-8 text"),
        ({"headers": {"h": "\ud800"}}, "header 'h' is not valid UTF-8 text"),
        ({"headers": {"h\ud800": "v"}}, "header name"),
        ({"headers": {"a\x00b": "v"}}, "header name"),
        ({"headers": {"": "v"}}, "header name"),
        ({"headers": {"h": "line\r\nInjected: 1"}}, "header 'h'"),
        ({"content_type": "text/plain\x00"}, "content_type"),
        ({"content_type": "text/plain\r\nX: 1"}, "content_type"),
        ({"content_type": 5}, "content_type"),
        ({"content_type": ""}, "content_type"),
        ({"deliver_after": timedelta.max}, "deliver_after"),
        ({"deliver_at": datetime(9999, 1, 1, tzinfo=UTC)}, "deliver_at"),
        ({"deliver_at": NOW + timedelta(days=400)}, "deliver_at"),
        ({"headers": {"big": "x" * 2000}}, "over the maximum of 1000"),
        ({"key": "k" * 2000}, "over the maximum of 1000"),
        ({"content_type": "x" * 2000}, "over the maximum of 1000"),
        ({"payload": nested(100_000)}, "not JSON-serialisable"),
        ({"headers": [("a", "b")], "cloudevent_source": "urn:x"}, "headers must be a mapping"),
        ({"deliver_at": datetime(2030, 1, 1, tzinfo=NoOffset())}, "timezone-aware"),
    ],
    ids=["surrogate-payload", "surrogate-json", "surrogate-key", "surrogate-header-value",
         "surrogate-header-name", "nul-header-name", "empty-header-name", "crlf-header-value",
         "nul-content-type", "crlf-content-type", "int-content-type", "empty-content-type",
         "timedelta-max", "year-9999", "beyond-max-delay", "big-header", "big-key",
         "big-content-type", "deep-json", "header-list-with-cloudevents", "no-offset"],
)
def test_bad_publish_input_is_one_invalid_message(engine: Engine, outbox: Outbox,
                                                  connections: list[str],
                                                  options: dict[str, object], error: str) -> None:
    kwargs: dict[str, object] = {"topic": "orders", "payload": {"id": 1}, **options}
    with pytest.raises(InvalidMessage) as raised:
        publish_and_commit(engine, outbox, **kwargs)
    assert error in str(raised.value)
    assert "\n" not in str(raised.value)
    assert connections == []


@pytest.mark.parametrize("group", [None, "", 5, "a\x00b", "orders-\udcff"])
def test_a_bad_producer_group_is_refused_when_the_outbox_is_made(group: object) -> None:
    """A lone surrogate (an environment value decoded with surrogateescape) passed, and
    every publish then raised a bare UnicodeEncodeError from the driver."""
    with pytest.raises(ConfigurationError, match="producer_group"):
        Outbox(settings=PublishSettings(), producer_group=group)  # type: ignore[arg-type]


def test_an_outbox_read_from_the_environment_warns_of_a_misspelt_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the CLI warned: an application's OUTBOX_SHCEMA published into the default schema
    without a word."""
    monkeypatch.setenv("OUTBOX_SHCEMA", "billing")
    with caplog.at_level(logging.WARNING, "outbox"):
        assert Outbox().schema == "outbox"
    assert "unknown setting OUTBOX_SHCEMA is ignored (did you mean OUTBOX_SCHEMA?)" in (
        caplog.text)


@pytest.mark.parametrize("settings", [RelaySettings(), {"schema_name": "shop"}])
def test_settings_that_are_not_publishing_settings_are_refused(settings: object) -> None:
    """A relay's settings lack max_payload_bytes: an AttributeError at the first publish."""
    with pytest.raises(ConfigurationError, match="settings must be a PublishSettings"):
        Outbox(settings=settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("source", ["", 5, "urn:\x00", "urn:\udcff"])
def test_a_bad_cloudevents_source_is_refused_when_the_outbox_is_made(source: object) -> None:
    """An empty one meant no CloudEvents at all, an int failed every publish later."""
    with pytest.raises(ConfigurationError, match="cloudevents_source"):
        Outbox(settings=PublishSettings(), cloudevents_source=source)  # type: ignore[arg-type]


@pytest.mark.parametrize("group", ["", 123])
def test_a_checker_for_a_bad_group_is_refused(outbox: Outbox, group: object) -> None:
    """An empty group fell back to the outbox's own, an int registered a group no message
    can have."""
    with pytest.raises(ConfigurationError, match="producer_group"):
        outbox.checker(group)  # type: ignore[call-overload]
    assert outbox.checkers == {}


def test_check_immunity_beyond_max_delay_is_refused(engine: Engine, outbox: Outbox,
                                                    connections: list[str]) -> None:
    """An undecided message holds back its key until its first check-back."""
    with pytest.raises(InvalidMessage, match=r"check_immunity .* longer than max_delay"), \
            Session(engine) as session, session.begin():
        outbox.prepare(session, "orders", {"id": 1}, check_immunity=timedelta(days=3650))
    assert connections == []


def test_send_in_transaction_refuses_a_non_callable_before_writing(
    engine: Engine, outbox: Outbox, connections: list[str]
) -> None:
    with pytest.raises(InvalidMessage, match="local_transaction must be callable"):
        outbox.send_in_transaction(engine, "orders", {"id": 1}, "not callable")  # type: ignore[call-overload]
    assert connections == []


def test_send_in_transaction_refuses_a_coroutine_function_it_cannot_await_before_writing(
    engine: Engine, outbox: Outbox, connections: list[str]
) -> None:
    """A synchronous engine cannot await ``async def``: the prepare row was committed, the
    coroutine never ran, and the error blamed its answer (``answered <coroutine ...>``)."""
    async def charge(message: object) -> str:
        return "COMMIT"

    for local in (charge, functools.partial(charge)):
        with pytest.raises(InvalidMessage, match=r"coroutine function \(async def\), which a "
                                                 r"synchronous Engine cannot await"):
            outbox.send_in_transaction(engine, "orders", {"id": 1}, local)  # type: ignore[call-overload]
    assert connections == []


@pytest.mark.parametrize("option", ["cloudevent_type", "cloudevent_source"])
@pytest.mark.parametrize("value", [b"order.placed", "a\nb", 5, ""])
def test_a_cloudevent_s_type_and_source_are_refused_unless_usable_text(
    engine: Engine, outbox: Outbox, connections: list[str], option: str, value: object
) -> None:
    """Bytes were sent as they were (invalid UTF-8 and newlines too), and other values were
    refused as a header named ``ce_type`` the caller never passed, told to pass bytes."""
    with pytest.raises(InvalidMessage, match=f"^{option} must be a non-empty str without "
                                             "control characters"):
        publish_and_commit(engine, outbox, topic="orders", payload={"id": 1},
                           **{"cloudevent_source": "urn:shop", option: value})
    assert connections == []


def test_a_delay_within_the_maximum_is_accepted_up_to_the_database(
    engine: Engine, outbox: Outbox, connections: list[str]
) -> None:
    with pytest.raises(Exception, match="no database"):
        publish_and_commit(engine, outbox, topic="orders", payload={"id": 1},
                           deliver_after=timedelta(days=1))
    assert connections == ["asked"]
