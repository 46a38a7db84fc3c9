"""Atomicity, no loss, no skipping and per-key order with one relay (docs/guarantees.md)."""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.dev.topics import read_topic
from outbox.relay.prefetch import Prefetch
from outbox.relay.relay import Relay
from outbox.schema import SHARDS
from outbox.settings import Settings
from tests.conftest import (
    both_transports,
    count_status,
    publish_orders,
    running_relay,
    wait_delivered,
    wait_until,
)


@both_transports
def test_committed_messages_are_delivered_exactly_once_with_op_records(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 7}", i) for i in range(50)])
    wait_delivered(engine, schema, 50)

    records = read_topic(settings.kafka_bootstrap, topic)
    assert sorted(r.message_id for r in records) == sorted(ids)
    by_id = {r.message_id: r for r in records}
    assert json.loads(by_id[ids[3]].value) == {"order": 3}
    assert by_id[ids[3]].key == b"k3"
    assert by_id[ids[3]].headers["content-type"] == b"application/json"
    with engine.connect() as conn:
        ops = conn.execute(text(
            f"SELECT message_id, action, actor, kafka_partition, kafka_offset "
            f"FROM {schema}.op_record"
        )).all()
    assert len(ops) == 50
    for op in ops:
        assert op.action == "DELIVERED"
        assert op.actor == settings.worker_id
        record = by_id[op.message_id]
        assert (op.kafka_partition, op.kafka_offset) == (record.partition, record.offset)


@both_transports
def test_rolled_back_messages_are_never_delivered(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    rolled_back = publish_orders(engine, outbox, topic, [("a", 1), ("b", 2)], commit=False)
    committed = publish_orders(engine, outbox, topic, [("a", 3)])
    wait_delivered(engine, schema, 1)

    delivered = {r.message_id for r in read_topic(settings.kafka_bootstrap, topic)}
    assert delivered == set(committed)
    assert not delivered & set(rolled_back)
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT count(*) FROM {schema}.message")).scalar_one()
    assert rows == 1


@both_transports
def test_late_commit_is_not_skipped(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    with Session(engine) as early:
        early.begin()
        early_id = outbox.publish(early, topic, {"order": "early"}, key="x")
        late_id = publish_orders(engine, outbox, topic, [("y", 2)])[0]
        assert early_id < late_id
        wait_delivered(engine, schema, 1)
        assert [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)] == [late_id]
        early.commit()
    wait_delivered(engine, schema, 2)
    order = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)]
    assert sorted(order) == [early_id, late_id]


@both_transports
def test_writers_of_one_key_are_ordered_by_commit(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    """A second writer of a key waits for the first to commit, so id order is commit order."""
    second_id: list[int] = []
    second = threading.Thread(
        target=lambda: second_id.extend(publish_orders(engine, outbox, topic, [("same", 2)]))
    )
    with Session(engine) as first:
        first.begin()
        first_id = outbox.publish(first, topic, {"n": 1}, key="same")
        second.start()
        second.join(0.5)
        waited = second.is_alive()
        first.commit()
    second.join(10)
    assert waited, "the second writer of the key should wait for the first to commit"
    assert second_id and first_id < second_id[0]
    wait_delivered(engine, schema, 2)
    records = read_topic(settings.kafka_bootstrap, topic)
    assert [r.message_id for r in records] == [first_id, second_id[0]]


@both_transports
def test_per_key_order_holds_across_many_keys_and_transactions(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    keys = [f"customer-{k}" for k in range(40)]
    sequence: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def writer(seed: int) -> None:
        for txn in range(25):
            batch = []
            for j in range(4):
                key = keys[(seed * 7 + txn * 3 + j) % len(keys)]
                with lock:
                    sequence[key] += 1
                batch.append((key, txn * 10 + j))
            publish_orders(engine, outbox, topic, batch, commit=(txn % 5 != 4))

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with engine.connect() as conn:
        expected = conn.execute(text(
            f"SELECT key, array_agg(id ORDER BY id) AS ids FROM {schema}.message GROUP BY key"
        )).all()
    total = sum(len(row.ids) for row in expected)
    assert total == 4 * 20 * 4  # one transaction in five rolled back
    wait_delivered(engine, schema, total)

    delivered: dict[bytes, list[int]] = defaultdict(list)
    for record in read_topic(settings.kafka_bootstrap, topic):
        assert record.key is not None and record.message_id is not None
        delivered[record.key].append(record.message_id)
    assert {bytes(row.key): list(row.ids) for row in expected} == dict(delivered)


@both_transports
def test_many_messages_in_one_transaction(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 3}", i) for i in range(1000)])
    wait_delivered(engine, schema, 1000)
    records = read_topic(settings.kafka_bootstrap, topic)
    assert sorted(r.message_id for r in records) == ids
    assert count_status(engine, schema, "PENDING") == 0


@both_transports
def test_a_backlog_fetched_ahead_of_its_sends_keeps_each_keys_order(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Draining a backlog with kafka-python, the relay fetches each next batch while it sends
    the one before (relay/prefetch.py): the batches it takes so are the ones it would have
    fetched. With librdkafka it does not (``fetch_ahead``)."""
    taken: list[int] = []
    take = Prefetch.take

    def counted(self: Prefetch, shards: object, held: object) -> object:
        batch = take(self, shards, held)  # type: ignore[arg-type]
        taken.append(len(batch or ()))
        return batch

    monkeypatch.setattr(Prefetch, "take", counted)
    ids = publish_orders(engine, outbox, topic, [(f"k{i % 7}", i) for i in range(1500)])
    with running_relay(settings):  # batches of 200
        wait_delivered(engine, schema, len(ids))
    ahead = sum(1 for n in taken if n)
    assert ahead >= 3 if settings.kafka_client == "kafka-python" else ahead == 0, taken
    delivered: dict[bytes, list[int]] = defaultdict(list)
    for record in read_topic(settings.kafka_bootstrap, topic):
        assert record.key is not None and record.message_id is not None
        delivered[record.key].append(record.message_id)
    assert {key.decode(): got for key, got in delivered.items()} == {
        f"k{k}": ids[k::7] for k in range(7)}, "each once, in id order per key"


@both_transports
def test_relay_wakes_on_commit_without_waiting_for_a_poll(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    slow_poll = settings.model_copy(update={"relay_poll_interval": 30.0})
    daemon = Relay(slow_poll)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: bool(daemon.owned_shards), 10, "relay to own its shards")
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1, timeout=10)
    finally:
        daemon.stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("in_one_statement", [False, True], ids=["two-steps", "one-statement"])
def test_a_batch_stops_at_its_byte_budget_but_always_holds_one_message(
    engine: Engine, outbox: Outbox, schema: str, in_one_statement: bool
) -> None:
    """Whether the batch's messages are read after its ids, or with them (a relay's
    fetching connection, once a batch was read from the range: store.Fetching.batch)."""
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, "big", b"x" * 300_000, key=f"k{i}") for i in range(5)]
    with engine.connect() as conn, engine.connect() as other:
        fetching = store.Fetching(other, schema) if in_one_statement else None

        def batch(max_bytes: int, *flights: list[int]) -> list[int]:
            in_flight = store.IdRanges.joined(map(store.IdRanges.of, flights))
            return [row.id for row in store.fetch_deliverable(
                conn, schema, range(SHARDS), 100, in_flight=in_flight,
                max_bytes=max_bytes, fetching=fetching)]

        if fetching is not None:
            assert batch(1) == ids[:1] and fetching.hot is not None

        assert batch(700_000) == ids[:3], "rows start below the budget: 0, 300 kB, 600 kB"
        assert batch(1_000_000_000) == ids
        assert batch(1024) == ids[:1], "one message bigger than the budget still goes"
        assert batch(700_000, ids[:3]) == ids[3:]
        # flights out of order, and not consecutive ids
        assert batch(1_000_000_000, [ids[3]], [ids[0], ids[2]]) == [ids[1], ids[4]]
        assert batch(1_000_000_000, [], [ids[4]], []) == ids[:4]
