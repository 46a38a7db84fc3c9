"""What a step of the relay's topic holds changes is written in one transaction
(relay/holds.py's ``_write``): if it fails, the next step writes it. Here a real lock timeout
fails it: another session holds the outbox table while the step runs."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.encoding import key_hash
from outbox.relay import holds
from outbox.schema import SHARDS
from outbox.settings import Settings
from tests.conftest import count_status, publish_orders
from tests.integration.test_topic_hold import HELD, held_flags, held_marks


@contextmanager
def table_locked(engine: Engine, schema: str) -> Iterator[None]:
    """Another session holds the outbox table: no row of it can be written meanwhile."""
    with engine.connect() as locker, locker.begin():
        locker.execute(text(f"LOCK TABLE {schema}.pending IN EXCLUSIVE MODE"))
        yield


@contextmanager
def unpooled(engine: Engine) -> Iterator[Connection]:
    """A connection of the shared engine that is not handed back to its pool, so the
    session settings a test commits on it end with it (a lock_timeout left on a pooled
    session cut off a later test's backlog count: test_observability, seen once)."""
    with engine.connect() as conn:
        try:
            yield conn
        finally:
            conn.invalidate()


def failed_step(held: holds.TopicHolds, conn: Connection, engine: Engine, schema: str) -> None:
    with table_locked(engine, schema), pytest.raises(OperationalError, match="lock timeout"):
        held.revisit(conn, range(SHARDS))


def test_a_step_whose_transaction_fails_is_written_by_the_next(
    engine: Engine, outbox: Outbox, schema: str, settings: Settings,
) -> None:
    """A topic held, then released, each by a step that failed: the held rows were noted
    and flagged, then unflagged, only by a later change of the hold (a refused topic is not
    noted again; its flags stayed until the heal, 10 s on), and the gauge said held while
    `outbox status` did not."""
    topic = f"denied-{uuid.uuid4().hex[:8]}"
    publish_orders(engine, outbox, topic, HELD)
    held = holds.TopicHolds(settings, transport=None)  # type: ignore[arg-type]  # never asked
    with unpooled(engine) as conn:
        conn.execute(text("SET lock_timeout = '200ms'"))
        conn.commit()
        held.refused(topic, "TopicAuthorizationFailedError: denied")
        failed_step(held, conn, engine, schema)
        assert held.topics == [topic]
        assert held_marks(engine, schema, topic) == 0
        assert REGISTRY.get_sample_value("outbox_topic_held", {"topic": topic}) is None, \
            "the gauge says held once the rows do"
        held.revisit(conn, range(SHARDS))
        assert held_marks(engine, schema, topic) == held_flags(engine, schema, topic) == len(
            HELD), "noted and flagged by the next step"
        assert REGISTRY.get_sample_value("outbox_topic_held", {"topic": topic}) == 1

        held._held[topic].retry_at = 0.0  # its back-off has passed: tried again
        held.revisit(conn, range(SHARDS))
        assert held.tried == {topic}
        held.landed([topic])  # Kafka took one of its records: released
        failed_step(held, conn, engine, schema)
        assert held.tried == frozenset() and held.topics == []
        assert held_flags(engine, schema, topic) > 0
        held.revisit(conn, range(SHARDS))
        assert held_flags(engine, schema, topic) == 0, "unflagged by the next step"


class KafkaKnowsNothing:
    """A transport whose Kafka has no metadata for any topic."""

    denied: frozenset[str] = frozenset()

    def available(self, topics: Collection[str], timeout: float) -> set[str]:
        return set()


def test_a_hold_taken_over_keeps_the_start_its_rows_say(
    engine: Engine, outbox: Outbox, schema: str, settings: Settings,
) -> None:
    """The next owner of a held topic's flagged rows holds it since the start their notes
    say, not since it took them over: `outbox status` says the same start, and a relay
    restarted more often than OUTBOX_TOPIC_HOLD_PARK_AFTER still parks them in time."""
    topic = f"missing-{uuid.uuid4().hex[:8]}"
    publish_orders(engine, outbox, topic, HELD)
    began = (datetime.now(UTC) - timedelta(seconds=100)).strftime(holds.BEGAN_FORMAT)
    reason = (f"held: Kafka has no metadata for topic {topic} (not created, or auto-creation "
              f"off) since {began}")
    with engine.begin() as conn:  # as a relay since stopped flagged them 100 s ago
        assert store.mark_held(conn, schema, {topic: reason}, range(SHARDS),
                               holds.FLAG_BATCH) == len(HELD)
    patient = settings.model_copy(update={"topic_hold_park_after": 1000.0})
    held = holds.TopicHolds(patient, transport=KafkaKnowsNothing())  # type: ignore[arg-type]
    with engine.connect() as conn:
        held.revisit(conn, range(SHARDS))
    assert held.topics == [topic]
    assert 99 <= time.monotonic() - held._held[topic].since < 130
    assert held._held[topic].reason == reason, "the notes of its later rows say the same"

    impatient = settings.model_copy(update={"topic_hold_park_after": 50.0})
    held = holds.TopicHolds(impatient, transport=KafkaKnowsNothing())  # type: ignore[arg-type]
    with engine.connect() as conn:
        held.revisit(conn, range(SHARDS))
        assert count_status(engine, schema, "PARKED") == 0
        held._held[topic].retry_at = 0.0  # its back-off has passed: held 100 s, over 50
        held.revisit(conn, range(SHARDS))
    assert count_status(engine, schema, "PARKED") == len(HELD)


def test_a_hold_taken_over_for_another_cause_notes_it_on_the_rows(
    engine: Engine, outbox: Outbox, schema: str, settings: Settings,
) -> None:
    """The rows say Kafka had no metadata for the topic; the relay taking them over finds
    Kafka will not describe it to the relay (a grant taken away meanwhile): `outbox status`
    must say the cause as it is now."""
    topic = f"denied-{uuid.uuid4().hex[:8]}"
    publish_orders(engine, outbox, topic, HELD)
    with engine.begin() as conn:
        store.mark_held(conn, schema, {topic: f"held: Kafka has no metadata for topic {topic} "
                                              "(...) since 2026-12-01 10:00:00 UTC"},
                        range(SHARDS), holds.FLAG_BATCH)
    kafka = KafkaKnowsNothing()
    kafka.denied = frozenset({topic})
    held = holds.TopicHolds(settings, transport=kafka)  # type: ignore[arg-type]
    with engine.connect() as conn:
        held.revisit(conn, range(SHARDS))
        held.revisit(conn, range(SHARDS))
        notes = conn.execute(text(f"SELECT DISTINCT last_error FROM {schema}.pending "
                                  "WHERE topic = :t"), {"t": topic}).scalars().all()
    assert notes == [f"held: Kafka will not describe topic {topic} to the relay "
                     "(TOPIC_AUTHORIZATION_FAILED: no Describe ACL?) since 2026-12-01 10:00:00 UTC"]


def test_topics_held_together_are_asked_about_again_together(
    engine: Engine, outbox: Outbox, schema: str, settings: Settings,
) -> None:
    """A batch of 40 topics Kafka does not know is held in one step, and each is asked about
    again at the same moment: one metadata request, and one line when they appear (each
    hold's back-off counted from its own clock read split them over several steps)."""
    topics = [f"many-{uuid.uuid4().hex[:8]}" for _ in range(40)]
    for topic in topics:
        publish_orders(engine, outbox, topic, [("k", 1)])
    held = holds.TopicHolds(settings, transport=KafkaKnowsNothing())  # type: ignore[arg-type]
    with engine.connect() as conn:
        batch = store.fetch_deliverable(conn, schema, range(SHARDS), 100)
        conn.rollback()
        assert held.admit(conn, range(SHARDS), batch) == []
    assert sorted(held.topics) == sorted(topics)
    assert len({hold.retry_at for hold in held._held.values()}) == 1


def test_a_refused_topic_is_tried_with_a_row_its_key_does_not_hold_back(
    engine: Engine, outbox: Outbox, schema: str,
) -> None:
    """The first held row of a shard waits behind a delayed row of its key: the trial sends
    another key's row of that shard, not that one, which the fetch would skip (the shard sent
    nothing, and the topic waited out the trial's 60 s, then had every row unflagged)."""
    topic = f"refused-{uuid.uuid4().hex[:8]}"
    shard_of = {key: key_hash(topic, key.encode()) % SHARDS for key in map(str, range(500))}
    first = "0"
    second = next(key for key, shard in shard_of.items()
                  if shard == shard_of[first] and key != first)
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, {"order": 0}, key=first,
                       deliver_after=timedelta(hours=1))
    blocked, free = publish_orders(engine, outbox, topic, [(first, 1), (second, 2)])
    shards = [shard_of[first]]
    with engine.begin() as conn:
        assert store.mark_held(conn, schema, {topic: f"held: Kafka refuses the records of "
                                                     f"topic {topic} (...)"},
                               shards, holds.FLAG_BATCH) == 2
        assert store.try_held(conn, schema, [topic], shards) == 1
        assert [row.id for row in store.fetch_deliverable(conn, schema, shards, 100)] == [free]
    assert held_flags(engine, schema, topic) == 1, f"{blocked} stays flagged"


def test_rows_with_keys_of_any_length_hold_their_key_back(
    engine: Engine, outbox: Outbox, schema: str,
) -> None:
    """Delayed, undecided and held rows are in the index of rows that hold their key back,
    whose entries PostgreSQL caps at 2,704 bytes. A prepared or delayed message's key over
    2,048 bytes was refused at publish; a plain one of a held topic failed the relay's
    flagging at every step ("index row size 3040 exceeds btree version 4 maximum 2704 for index
    pending_hold_idx"), which paused the relay, every topic with it. The index holds a key's
    first 2,048 bytes (revision 0025): any key waits, and holds back its key's later rows."""
    topic = f"held-{uuid.uuid4().hex[:8]}"
    delayed, undecided, held = os.urandom(3000), os.urandom(100_000), os.urandom(3000)
    with Session(engine) as session, session.begin():
        outbox.publish(session, topic, {"n": 0}, key=delayed, deliver_after=timedelta(hours=1))
        outbox.prepare(session, topic, {"n": 1}, key=undecided)
        first = outbox.publish(session, topic, {"n": 2}, key=held)
    with Session(engine) as session, session.begin():
        behind = [outbox.publish(session, topic, {"n": 3 + i}, key=key)
                  for i, key in enumerate((delayed, undecided, held))]
        free = outbox.publish(session, topic, {"n": 6}, key=b"short")
    reason = f"held: Kafka refuses the records of topic {topic} (...)"
    with engine.begin() as conn:
        assert store.mark_held(conn, schema, {topic: reason}, range(SHARDS),
                               holds.FLAG_BATCH) == 5
        assert store.release_held(conn, schema, [topic], range(SHARDS), holds.FLAG_BATCH) == 5
        conn.execute(text(f"UPDATE {schema}.pending SET held = true WHERE message_id = :id"),
                     {"id": first})
        assert [row.id for row in store.fetch_deliverable(conn, schema, range(SHARDS), 100)
                if row.topic == topic] == [free]
        assert store.release_held(conn, schema, [topic], range(SHARDS), holds.FLAG_BATCH) == 1
        assert [row.id for row in store.fetch_deliverable(conn, schema, range(SHARDS), 100)
                if row.topic == topic] == [first, behind[2], free]
