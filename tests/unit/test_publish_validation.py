"""Bad input to publish gets a one-line error before any statement is sent (docs/guarantees.md).

The ``engine`` (tests/unit/conftest.py) counts the connections publish asks for and refuses
them all: a rejected message never reaches the database, so nothing can be half-written.
Accepted messages and the size limits are proven against the real database in
tests/integration/test_validation.py.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from outbox import ConfigurationError, InvalidMessage, Outbox
from outbox.relay.sweeper import checkers_for
from outbox.settings import PublishSettings, SweepSettings


@pytest.fixture
def outbox() -> Outbox:
    return Outbox(settings=PublishSettings(database_url="postgresql://app@nowhere/shop"))


def publish_and_commit(engine: Engine, outbox: Outbox, **kwargs: object) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "topic", ["", ".", "..", "has space", "x" * 250, "ordres-é", "a/b", None, 42]
)
def test_invalid_topic_names_are_rejected(engine: Engine, outbox: Outbox,
                                          connections: list[str], topic: object) -> None:
    with pytest.raises(InvalidMessage, match="invalid Kafka topic name"):
        publish_and_commit(engine, outbox, topic=topic, payload={"a": 1})
    assert connections == []


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"trace": 5}, "header 'trace' must be str or bytes, got int"),
        ({7: "x"}, "header name 7 must be a str"),
        ([("a", "b")], "headers must be a mapping"),
        ({"outbox-id": "1"}, "set by the outbox itself"),
    ],
)
def test_bad_headers_are_rejected(engine: Engine, outbox: Outbox, connections: list[str],
                                  headers: object, error: str) -> None:
    with pytest.raises(InvalidMessage, match=error):
        publish_and_commit(engine, outbox, topic="t", payload="p", headers=headers)
    assert connections == []


@pytest.mark.parametrize("payload", [object(), {"when": {1, 2}}, float("nan")])
def test_unserialisable_payload_is_rejected(engine: Engine, outbox: Outbox,
                                            connections: list[str], payload: object) -> None:
    with pytest.raises(InvalidMessage, match="is not JSON-serialisable"):
        publish_and_commit(engine, outbox, topic="t", payload=payload)
    assert connections == []


def test_bad_key_type_is_rejected(engine: Engine, outbox: Outbox) -> None:
    with pytest.raises(InvalidMessage, match="key must be str, bytes or None, got int"):
        publish_and_commit(engine, outbox, topic="t", payload="p", key=12)


def test_a_valid_message_does_reach_for_the_database(engine: Engine, outbox: Outbox,
                                                     connections: list[str]) -> None:
    """The counting engine is not blind: a message that passes validation asks for one."""
    with pytest.raises(Exception, match="the unit tier has no database"):
        publish_and_commit(engine, outbox, topic="t", payload="p")
    assert connections == ["asked"]


def test_checker_registers_with_or_without_parentheses() -> None:
    outbox = Outbox(settings=PublishSettings(), producer_group="shop")

    @outbox.checker
    def bare(message: object, conn: object) -> str:
        return "COMMIT"

    @outbox.checker("billing")
    def named(message: object, conn: object) -> str:
        return "ROLLBACK"

    assert outbox.checkers == {"shop": bare, "billing": named}


class AsyncCheck:
    async def __call__(self, message: object, conn: object) -> str:
        return "COMMIT"


async def async_check(message: object, conn: object, extra: int = 0) -> str:
    return "COMMIT"


@pytest.mark.parametrize("checker", [async_check, functools.partial(async_check, extra=1),
                                     AsyncCheck()])
def test_a_checker_the_sweeper_cannot_call_is_refused_at_once(checker: object) -> None:
    """An ``async def`` checker answered a coroutine nothing awaited: each check counted as
    inconclusive, and the message was discarded. It is refused when registered, and by the
    sweeper (``outbox sweep`` exits 2) for checkers put in the dict directly."""
    outbox = Outbox(settings=PublishSettings(), producer_group="shop")
    with pytest.raises(ConfigurationError, match="checker of producer group 'shop' is"):
        outbox.checker(checker)  # type: ignore[call-overload]
    assert outbox.checkers == {}
    with pytest.raises(ConfigurationError, match="checker of producer group 'shop' is"):
        checkers_for(SweepSettings(), {"shop": checker})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="checker of producer group 'shop' is not"):
        checkers_for(SweepSettings(), {"shop": "COMMIT"})  # type: ignore[dict-item]


def one_argument(message: object) -> str:
    return "COMMIT"


def keyword_only(message: object, *, conn: object) -> str:
    return "COMMIT"


@pytest.mark.parametrize("checker", [one_argument, keyword_only, lambda: "COMMIT"])
def test_a_checker_that_cannot_take_a_message_and_a_connection_is_refused_at_once(
    checker: object,
) -> None:
    """``def answer(message)`` was registered; each check raised TypeError, counted as
    inconclusive, until the message was discarded."""
    outbox = Outbox(settings=PublishSettings(), producer_group="shop")
    with pytest.raises(ConfigurationError, match=r"checker of producer group 'shop' cannot be "
                       r"called as checker\(message, connection\): "):
        outbox.checker(checker)  # type: ignore[call-overload]
    assert outbox.checkers == {}
    with pytest.raises(ConfigurationError, match="cannot be called as"):
        checkers_for(SweepSettings(), {"shop": checker})  # type: ignore[dict-item]


def test_a_checker_with_defaults_or_varargs_is_taken() -> None:
    outbox = Outbox(settings=PublishSettings(), producer_group="shop")
    outbox.checker("a")(lambda message, conn, retries=3: "COMMIT")
    outbox.checker("b")(lambda *args: "COMMIT")
    outbox.checker("c")(functools.partial(lambda extra, message, conn: "COMMIT", 1))
    assert set(outbox.checkers) == {"a", "b", "c"}


class Order:
    """A mapped class's stand-in: ``binds`` routes by it."""


def test_a_session_routing_to_several_engines_is_refused(
    engine: Engine, outbox: Outbox, connections: list[str]
) -> None:
    """The message went through the session's default engine: a connection and transaction
    other than the business rows', committed or lost apart from them."""
    replica = create_engine("postgresql+psycopg://app@replica/shop")

    class Routing(Session):
        def get_bind(self, *args: object, **kwargs: object) -> Engine:
            return replica

    for session in (Session(engine, binds={Order: replica}), Routing()):
        with session, session.begin(), pytest.raises(ConfigurationError,
                                                     match="routes to several engines"):
            outbox.publish(session, "orders", {"id": 1})
    assert connections == []


def test_a_session_of_another_database_is_refused_as_such(outbox: Outbox) -> None:
    """A new session of SQLite was told to open a transaction; once it had one, that it is
    not PostgreSQL. It is told that at once."""
    lite = create_engine("sqlite://")
    with Session(lite) as session:
        with pytest.raises(ConfigurationError, match="the outbox needs PostgreSQL, but this "
                           "session uses sqlite"):
            outbox.publish(session, "orders", {"id": 1})
        with session.begin(), pytest.raises(ConfigurationError, match="uses sqlite"):
            outbox.publish(session, "orders", {"id": 1})


def test_processes_forked_from_one_outbox_place_keyless_messages_apart(outbox: Outbox) -> None:
    """An Outbox made before a fork (gunicorn --preload, Celery's prefork pool) drew its
    random shards from a generator the children shared: each child placed its keyless
    messages on the same shards in the same order."""
    def shards_in_a_child() -> list[int]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its first shards, then gone without pytest's teardown
            shards = [outbox._encode("orders", {}, {}).shard for _ in range(16)]
            os.write(write, json.dumps(shards).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            shards = json.loads(pipe.read())
        os.waitpid(pid, 0)
        return list(shards)

    assert shards_in_a_child() != shards_in_a_child()
