"""Taking over a dead relay's shards sends nothing twice: the new owner reads the partitions'
tails and records what the dead relay got acknowledged but never recorded (relay/recovery.py).

The dead relay's gap is made for real: a test transaction locks ``op_record`` against writes,
so the relay fetches, sends and gets every ack, then blocks recording them; it is killed with
-9 there, and its waiting statement ended."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections import Counter

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.dev.topics import read_topic
from outbox.relay.confluent import ConfluentTailReader
from outbox.relay.leases import Leases
from outbox.relay.recovery import Recovery
from outbox.relay.tails import KafkaPythonTailReader, Stopped, make_tail_reader
from outbox.settings import Settings
from tests.conftest import (
    both_transports,
    count_status,
    delivered_to,
    fresh_schema,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.processes import start_outbox

pytestmark = both_transports
MESSAGES = 300


def publish_mixed(engine: Engine, outbox: Outbox, *topics: str, origin: str = "here",
                  each: int = MESSAGES) -> list[int]:
    """Keyed messages (on the partitions their keys map to) and unkeyed ones (anywhere),
    ``each`` to each topic."""
    with Session(engine) as session, session.begin():
        return [outbox.publish(session, topic, {"n": n, "from": origin},
                               key=f"k{n % 7}" if n % 3 else None)
                for topic in topics for n in range(each)]


def killed_after_its_sends(engine: Engine, schema: str, settings: Settings, topics: list[str],
                           records: int) -> None:
    """A relay named ``dead`` sends the pending messages, gets every ack and records none
    (``op_record`` locked): it is killed with -9 once ``topics`` hold ``records`` records."""
    with engine.connect() as lock:
        lock.begin()
        lock.execute(text(f"LOCK TABLE {schema}.op_record IN EXCLUSIVE MODE"))
        dead = start_outbox(settings, "relay", OUTBOX_WORKER_ID="dead")
        try:
            wait_until(lambda: sum(len(read_topic(settings.kafka_bootstrap, topic))
                                   for topic in topics) >= records,
                       60, "every message acknowledged by Kafka")
        finally:
            dead.kill()
            dead.wait(10)
        # The dead relay's recording statement still waits on the lock; PostgreSQL would run
        # it once the lock goes, so end it as a dropped connection would.
        lock.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE wait_event_type = 'Lock' AND query LIKE :statement"),
                     {"statement": f"%{schema}.op_record%"})
        lock.rollback()


def deliver_as_heir(engine: Engine, schema: str, settings: Settings) -> None:
    """A relay named ``heir`` takes the shards over and delivers the messages."""
    heir = start_outbox(settings, "relay", OUTBOX_WORKER_ID="heir")
    try:
        wait_delivered(engine, schema, MESSAGES)
    finally:
        heir.send_signal(signal.SIGTERM)
        heir.wait(30)


def leases_clean(engine: Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            f"SELECT bool_and(clean) FROM {schema}.relay_lease")).scalar_one())


def test_new_owner_records_what_a_killed_relay_sent_instead_of_sending_it_again(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    ids = publish_mixed(engine, outbox, topic)
    killed_after_its_sends(engine, schema, settings, [topic], MESSAGES)
    with engine.connect() as conn:
        recorded = conn.execute(text(f"SELECT count(*) FROM {schema}.op_record")).scalar_one()
    assert recorded == 0, "the killed relay recorded nothing"
    assert not leases_clean(engine, schema), "a killed relay's shards are not handed back clean"

    deliver_as_heir(engine, schema, settings)

    records = read_topic(settings.kafka_bootstrap, topic)
    assert Counter(r.message_id for r in records) == Counter(ids), "each message once"
    with engine.connect() as conn:
        ledger = {row.message_id: (row.kafka_partition, row.kafka_offset, row.actor)
                  for row in conn.execute(text(
                      f"SELECT message_id, kafka_partition, kafka_offset, actor "
                      f"FROM {schema}.op_record WHERE action = 'DELIVERED'"))}
    assert {r.message_id: (r.partition, r.offset, "heir (recovered)") for r in records} \
        == ledger, "each op record names where the message really is"


def test_a_takeover_over_several_topics_reads_their_tails_together_each_from_its_own_start(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tails of many topics are read on one consumer, a few topics a read, and the
    offsets they start after are looked up for all of them at once (a consumer and four
    statements per topic took 0.6 s a topic with librdkafka). Each topic's tail must still
    start after its own last recorded offsets: only the dead relay's records are read."""
    topics = [topic, f"{topic}-b", f"{topic}-c"]
    with running_relay(settings):
        publish_mixed(engine, outbox, *topics, each=30)
        wait_delivered(engine, schema, 90)
    ids = publish_mixed(engine, outbox, *topics, each=60)
    killed_after_its_sends(engine, schema, settings, topics, 270)
    for reader in (KafkaPythonTailReader, ConfluentTailReader):  # two reads: 2 topics, 1
        monkeypatch.setattr(reader, "partitions_per_read", 8)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    heir = settings.model_copy(update={"worker_id": "heir"})
    with engine.connect() as conn:
        with conn.begin():  # the dead relay's leases run out, and it is forgotten
            conn.execute(text(f"UPDATE {schema}.relay_lease SET expires_at = now()"))
            conn.execute(text(f"DELETE FROM {schema}.relay_member"))
        leases = Leases(schema, "heir", 3600)
        leases.tick(conn)
        assert len(leases.unsettled) == 64
        Recovery(heir).settle(conn, leases)
    assert "read 180 records of the tails of 3 topics, 180 messages were already in Kafka" \
        in caplog.text
    records = [r for t in topics for r in read_topic(settings.kafka_bootstrap, t)]
    assert Counter(r.message_id for r in records) == Counter(range(1, 271))
    with engine.connect() as conn:
        ledger = {row.message_id: (row.topic, row.kafka_partition, row.kafka_offset)
                  for row in conn.execute(text(
                      f"SELECT o.message_id, m.topic, o.kafka_partition, o.kafka_offset "
                      f"FROM {schema}.op_record AS o JOIN {schema}.message AS m "
                      f"ON m.id = o.message_id WHERE o.action = 'DELIVERED'"))}
    assert ledger == {r.message_id: (r.topic, r.partition, r.offset) for r in records}
    assert set(ids) <= set(ledger)


def test_a_settle_reads_no_more_tail_than_its_limit_and_leaves_the_rest_to_be_sent_again(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    caplog: pytest.LogCaptureFixture
) -> None:
    """``relay_tail_max_records`` bounds a settle's reads: each read took up to 10,000
    records a poll whatever was left of it, so a limit below that was never reached. The
    messages whose records lie beyond it stay pending and are sent again, with a warning."""
    publish_mixed(engine, outbox, topic)
    killed_after_its_sends(engine, schema, settings, [topic], MESSAGES)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    heir = settings.model_copy(update={"worker_id": "heir", "relay_tail_max_records": 100})
    with engine.connect() as conn:
        with conn.begin():
            conn.execute(text(f"UPDATE {schema}.relay_lease SET expires_at = now()"))
            conn.execute(text(f"DELETE FROM {schema}.relay_member"))
        leases = Leases(schema, "heir", 3600)
        leases.tick(conn)
        Recovery(heir).settle(conn, leases)
        assert not leases.unsettled, "settled, though not wholly read"
        recovered = conn.execute(text(
            f"SELECT count(*) FROM {schema}.op_record WHERE actor = 'heir (recovered)'"
        )).scalar_one()
    assert f"the tails read to settle 64 shards reached 100 records in topic {topic} " \
        "(OUTBOX_RELAY_TAIL_MAX_RECORDS)" in caplog.text
    assert "read 100 records of the tails of 1 topic" in caplog.text
    assert recovered == 100, "each record read is a message recorded where it is"
    assert count_status(engine, schema, "PENDING") == MESSAGES - recovered


def test_messages_in_doubt_are_recorded_in_shards_about_to_be_handed_back(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    """A failed pass's messages in doubt are looked for in their tails before the relay
    fetches again, also those of shards it is about to hand back (a relay joined while it
    read). Those were left out of the recording and yet no longer doubted, so the shards went
    back clean and their next owner sent the messages again (the chaos test's duplicate: a
    PostgreSQL restart failed a pass as a third relay started)."""
    ids = publish_mixed(engine, outbox, topic)
    killed_after_its_sends(engine, schema, settings, [topic], MESSAGES)
    with engine.connect() as conn:
        with conn.begin():  # as if the sender had held the shards all along
            conn.execute(text(f"UPDATE {schema}.relay_lease SET owner = NULL, "
                              "expires_at = NULL, clean = true"))
            conn.execute(text(f"DELETE FROM {schema}.relay_member"))
        leases = Leases(schema, "sender", 3600)
        leases.tick(conn)
        leases.doubt(ids)  # its pass failed before it recorded them
        with conn.begin():
            conn.execute(text(f"INSERT INTO {schema}.relay_member (worker_id, seen_at, "
                              "in_flight) VALUES ('joined', now(), 0)"))
        leases.tick(conn)
        assert len(leases.surplus) == 32, "a relay joined: half the shards are to go"
        Recovery(settings.model_copy(update={"worker_id": "sender"})).settle(conn, leases)
        assert not leases.doubted
        leases.shed(conn)
    assert count_status(engine, schema, "PENDING") == 0, "every message found is recorded"
    ledger = delivered_to(engine, schema, settings.kafka_bootstrap, topic)
    assert sorted(ledger) == ids


def test_graceful_stop_hands_shards_back_clean(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    publish_mixed(engine, outbox, topic)
    relay = start_outbox(settings, "relay")
    try:
        wait_delivered(engine, schema, MESSAGES)
        assert not leases_clean(engine, schema), "an owned shard is not clean"
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    assert leases_clean(engine, schema), "the next owner may skip reading the tails"


def test_a_tail_record_of_another_outbox_with_the_same_id_is_not_taken_for_ours(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    migration_script: str
) -> None:
    """Two outboxes (two services, or two schemas) publishing to one topic number their
    messages from 1 each. A takeover that trusted ``outbox-id`` alone recorded this outbox's
    pending message N as delivered at the other's record N, and never sent it."""
    with fresh_schema(engine, migration_script, prefix="other") as other:
        neighbour = settings.model_copy(update={"schema_name": other})
        theirs = publish_mixed(engine, Outbox(settings=neighbour), topic, origin="there")
        with running_relay(neighbour):
            wait_delivered(engine, other, MESSAGES)

    dead = start_outbox(settings, "relay", OUTBOX_WORKER_ID="dead")
    try:
        wait_until(lambda: not leases_clean(engine, schema), 30, "the dead relay's leases")
    finally:
        dead.kill()
        dead.wait(10)
    ours = publish_mixed(engine, outbox, topic)
    assert ours == theirs, "both outboxes number their messages alike"

    deliver_as_heir(engine, schema, settings)
    with engine.connect() as conn:
        actors = Counter(conn.execute(text(
            f"SELECT actor FROM {schema}.op_record WHERE action = 'DELIVERED'")).scalars())
    assert actors == {"heir": MESSAGES}, "every message sent, none taken for another's record"
    ledger = delivered_to(engine, schema, settings.kafka_bootstrap, topic)
    assert sorted(ledger) == ours
    assert {json.loads(r.value)["from"] for r in ledger.values()} == {"here"}, \
        "each op record names a record of this outbox"


def test_a_tail_read_ends_when_its_relay_stops(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    """A takeover's tail read (up to relay_tail_max_records records, and 15 s per stalled
    poll) looked at neither signal: a stopping relay went on reading until its platform
    killed it. Stopping now ends it."""
    publish_mixed(engine, outbox, topic)
    with running_relay(settings):
        wait_delivered(engine, schema, MESSAGES)
    stop = threading.Event()
    reader = make_tail_reader(settings, stop)
    try:
        starts = dict.fromkeys((topic, p) for p in range(reader.partitions(topic)))
        assert reader.read(starts, 10_000).records == MESSAGES
        stop.set()
        with pytest.raises(Stopped):
            reader.read(starts, 10_000)
    finally:
        reader.close()


def test_a_settling_ends_when_its_relay_stops_and_leaves_the_shards_unsettled(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    caplog: pytest.LogCaptureFixture
) -> None:
    """It looked at no signal between its tail reads: a relay told to stop, even twice,
    went on settling (each topic a read; half an hour over 5,000 topics)."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    publish_mixed(engine, outbox, topic)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema}.relay_lease SET owner = 'dead', clean = false, "
                          "expires_at = now() - interval '1 second'"))
    stop = threading.Event()
    stop.set()
    leases = Leases(schema, "heir", 30)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        leases.tick(conn)
        assert len(leases.unsettled) == 64
        Recovery(settings.model_copy(update={"worker_id": "heir"}), stop).settle(conn, leases)
        assert len(leases.unsettled) == 64, "left for their next owner"
    assert "relay heir stopped while it settled 64 shards" in caplog.text
    assert not leases_clean(engine, schema)
