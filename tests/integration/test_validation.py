"""Bad input to publish gets a one-line error and writes nothing (docs/guarantees.md).

The table-driven rejections, which fail before any statement, are in
tests/unit/test_publish_validation.py."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import InvalidMessage, NotInTransaction, Outbox
from outbox.settings import Settings


def message_count(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {schema}.message")).scalar_one())


def publish_and_commit(engine: Engine, outbox: Outbox, **kwargs: object) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("topic", ["a", "orders.v1", "A-b_c.9", "x" * 249, "..."])
def test_valid_topic_names_are_accepted(engine: Engine, outbox: Outbox, schema: str,
                                        topic: str) -> None:
    publish_and_commit(engine, outbox, topic=topic, payload="ok")
    assert message_count(engine, schema) == 1


def test_payload_over_the_maximum_is_rejected(engine: Engine, settings: Settings,
                                              schema: str) -> None:
    small = Outbox(settings=settings.model_copy(update={"max_payload_bytes": 100}))
    publish_and_commit(engine, small, topic="t", payload=b"x" * 100)
    with pytest.raises(InvalidMessage, match="payload is 101 bytes, over the maximum of 100"):
        publish_and_commit(engine, small, topic="t", payload=b"x" * 101)
    assert message_count(engine, schema) == 1


def test_a_message_that_waits_takes_a_key_of_any_length(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    """A prepared or delayed message's key is in a B-tree index of the rows that hold their
    key back, whose entries PostgreSQL caps at 2,704 bytes: a 3,000-byte random key failed
    the caller's whole transaction with "index row size ... exceeds btree version 4
    maximum", then was refused over 2,048 bytes. Since revision 0025 the index holds a long
    key's digest: such keys are taken, as a plain publish takes them."""
    topic = "t" * 249
    with Session(engine) as session, session.begin():
        for key in (os.urandom(2048), os.urandom(3000), os.urandom(100_000)):
            outbox.prepare(session, topic, "ok", key=key)
            outbox.publish(session, topic, "ok", key=key, deliver_after=timedelta(hours=1))
            outbox.publish(session, topic, "ok", key=key)
    assert message_count(engine, schema) == 9


def test_default_maximum_is_one_mebibyte(engine: Engine, outbox: Outbox, schema: str) -> None:
    with pytest.raises(InvalidMessage, match="over the maximum of 1048576"):
        publish_and_commit(engine, outbox, topic="t", payload=b"x" * (1024 * 1024 + 1))
    assert message_count(engine, schema) == 0


def test_publish_outside_a_transaction_is_rejected(engine: Engine, outbox: Outbox,
                                                   schema: str) -> None:
    with Session(engine) as session, pytest.raises(NotInTransaction, match="open transaction"):
        outbox.publish(session, "t", {"a": 1})
    with engine.connect() as conn, pytest.raises(NotInTransaction):
        outbox.publish(conn, "t", {"a": 1})
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as conn:
        conn.execute(text("SELECT 1"))
        with pytest.raises(NotInTransaction, match="not in autocommit mode"):
            outbox.publish(conn, "t", {"a": 1})
    assert message_count(engine, schema) == 0


def test_payload_types_set_the_content_type(engine: Engine, outbox: Outbox,
                                            schema: str) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, "t", b"\x00\x01")
        outbox.publish(session, "t", "héllo")
        outbox.publish(session, "t", {"b": [1, 2]})
        outbox.publish(session, "t", "<a/>", content_type="application/xml")
    with engine.connect() as conn:
        rows = conn.execute(text(
            f"SELECT payload, content_type FROM {schema}.message ORDER BY id")).all()
    assert [(bytes(r.payload), r.content_type) for r in rows] == [
        (b"\x00\x01", "application/octet-stream"),
        ("héllo".encode(), "text/plain; charset=utf-8"),
        (b'{"b":[1,2]}', "application/json"),
        (b"<a/>", "application/xml"),
    ]


def test_publish_with_a_plain_connection_in_a_transaction(engine: Engine, outbox: Outbox,
                                                          schema: str) -> None:
    with engine.begin() as conn:
        message_id = outbox.publish(conn, "t", {"a": 1}, headers={"h": b"\xff", "s": "v"})
    assert message_id > 0
    assert message_count(engine, schema) == 1


def test_publish_into_an_unmigrated_schema_says_how_to_fix_it(engine: Engine,
                                                              settings: Settings) -> None:
    from outbox import SchemaNotMigrated

    unmigrated = Outbox(settings=settings, schema="never_migrated")
    with Session(engine) as session, session.begin(), pytest.raises(
            SchemaNotMigrated, match="run `outbox --schema never_migrated db upgrade`"):
        unmigrated.publish(session, "t", {"a": 1})

