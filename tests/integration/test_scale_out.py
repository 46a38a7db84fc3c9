"""Several relays share the shards, keep per-key order and take over from each other
(docs/guarantees.md)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

from sqlalchemy import Engine, text

from outbox import Outbox, store
from outbox.dev.topics import read_topic
from outbox.schema import SHARDS
from outbox.settings import Settings
from tests.conftest import (
    both_transports,
    publish_orders,
    running_relay,
    wait_delivered,
    wait_until,
)
from tests.plans import queue
from tests.processes import start_outbox

pytestmark = both_transports


def owners(engine: Engine, schema: str) -> Counter[str | None]:
    with engine.connect() as conn:
        return Counter(conn.execute(text(
            f"SELECT CASE WHEN expires_at > now() THEN owner END FROM {schema}.relay_lease"
        )).scalars())


def publish_concurrently(engine: Engine, outbox: Outbox, topic: str, writers: int,
                         transactions: int, keys: int) -> list[int]:
    ids: list[int] = []
    lock = threading.Lock()

    def write(seed: int) -> None:
        for t in range(transactions):
            batch = [(f"key-{(seed * 13 + t * 7 + j) % keys}", t) for j in range(3)]
            new = publish_orders(engine, outbox, topic, batch)
            with lock:
                ids.extend(new)

    threads = [threading.Thread(target=write, args=(seed,)) for seed in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ids


def assert_per_key_order(engine: Engine, schema: str, bootstrap: str, topic: str,
                         logs: str = "") -> Counter[int]:
    """Each key's first occurrences in Kafka follow its ids; returns how often each id came.
    A failure says, for each key out of order, where its first id is in the topic and what
    its op records say, then ``logs`` (the relays' output)."""
    with engine.connect() as conn:
        expected = {bytes(k): list(ids) for k, ids in conn.execute(text(
            f"SELECT key, array_agg(id ORDER BY id) FROM {schema}.message GROUP BY key"))}
    firsts: dict[bytes, list[int]] = {}
    seen: Counter[int] = Counter()
    where: dict[int, list[tuple[int, int]]] = {}
    for record in read_topic(bootstrap, topic):
        assert record.key is not None and record.message_id is not None
        if not seen[record.message_id]:
            firsts.setdefault(record.key, []).append(record.message_id)
        seen[record.message_id] += 1
        where.setdefault(record.message_id, []).append((record.partition, record.offset))
    wrong = [key for key in expected if firsts.get(key) != expected[key]]
    if wrong:
        first_ids = [expected[key][0] for key in wrong]
        with engine.connect() as conn:
            ops = conn.execute(text(
                f"SELECT message_id, action, actor, kafka_partition, kafka_offset, created_at, "
                f"detail FROM {schema}.op_record WHERE message_id = ANY(:ids) ORDER BY id"),
                {"ids": first_ids}).all()
        report = [f"{key!r}: ids {expected[key][:4]}..., first in Kafka "
                  f"{firsts.get(key, [])[:4]}...; id {expected[key][0]} is at (partition, "
                  f"offset) {where.get(expected[key][0], 'nowhere')}" for key in wrong]
        raise AssertionError("\n".join([f"{len(wrong)} keys out of order", *report,
                                         "op records of their first ids:",
                                         *map(str, ops), logs]))
    return seen


def test_two_relays_split_the_shards_and_keep_each_keys_order(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    with running_relay(settings.model_copy(update={"worker_id": "relay-a"})):
        wait_until(lambda: owners(engine, schema)["relay-a"] == SHARDS, 10, "relay-a owns all")
        with running_relay(settings.model_copy(update={"worker_id": "relay-b"})):
            wait_until(lambda: owners(engine, schema) == Counter(
                {"relay-a": SHARDS // 2, "relay-b": SHARDS // 2}), 15, "an even split")
            ids = publish_concurrently(engine, outbox, topic, writers=4, transactions=100,
                                       keys=60)
            wait_delivered(engine, schema, len(ids), timeout=60)
    by_actor = delivered_by(engine, schema)
    assert set(by_actor) == {"relay-a", "relay-b"}, "both relays delivered"
    seen = assert_per_key_order(engine, schema, settings.kafka_bootstrap, topic)
    assert set(seen) == set(ids)
    assert max(seen.values()) == 1, "no failure, so no duplicate"


def test_graceful_stop_hands_the_shards_over_at_once(
    engine: Engine, settings: Settings, schema: str
) -> None:
    long_lease = settings.model_copy(update={"relay_lease_seconds": 30})
    with running_relay(long_lease.model_copy(update={"worker_id": "stays"})):
        wait_until(lambda: owners(engine, schema)["stays"] == SHARDS, 10, "stays owns all")
        with running_relay(long_lease.model_copy(update={"worker_id": "leaves"})):
            joined = time.monotonic()
            wait_until(lambda: owners(engine, schema)["leaves"] == SHARDS // 2, 15, "a split")
            assert time.monotonic() - joined < 10, "rebalanced long before a lease renewal"
        stopped = time.monotonic()
        wait_until(lambda: owners(engine, schema)["stays"] == SHARDS, 10,
                   "the remaining relay to own every shard")
        assert time.monotonic() - stopped < 10, "handed over long before the 30 s lease ends"


def test_a_relay_joining_a_busy_one_takes_its_share_of_the_backlog(
    engine: Engine, settings: Settings, schema: str, topic: str
) -> None:
    """A relay draining a backlog never waits for a notification, so it reads them between
    batches: it hands a newcomer its share long before its next lease renewal (20 s here),
    and the newcomer delivers from the moment it holds shards, not a poll (30 s) later."""
    slow = settings.model_copy(update={"relay_lease_seconds": 60, "relay_poll_interval": 30,
                                       "relay_batch_size": 1})
    ids = queue(engine, schema, topic, 6_000, shards=SHARDS)
    with running_relay(slow.model_copy(update={"worker_id": "busy"})):
        wait_until(lambda: delivered_by(engine, schema).get("busy", 0) > 0, 30,
                   "the first relay to deliver")
        with running_relay(slow.model_copy(update={"worker_id": "newcomer"})):
            wait_until(lambda: delivered_by(engine, schema).get("newcomer", 0) > 0, 15,
                       "the newcomer to deliver its share of the backlog")
            split = delivered_by(engine, schema)
            wait_delivered(engine, schema, len(ids), timeout=120)
    assert split["busy"] < len(ids) - 1_000, "joined long before the backlog ran out"
    seen = assert_per_key_order(engine, schema, settings.kafka_bootstrap, topic)
    assert set(seen) == set(ids)


def test_a_busy_relay_takes_the_shards_of_one_that_stops_at_once(
    engine: Engine, settings: Settings, schema: str, topic: str
) -> None:
    """The other way round: a relay stopping gracefully hands its shards back with a NOTIFY,
    and a relay draining a backlog takes them between batches, not at its next lease
    renewal (100 s here)."""
    slow = settings.model_copy(update={"relay_lease_seconds": 300, "relay_poll_interval": 30,
                                       "relay_batch_size": 1})
    with running_relay(slow.model_copy(update={"worker_id": "stays"})):
        wait_until(lambda: owners(engine, schema)["stays"] == SHARDS, 10, "stays owns all")
        with running_relay(slow.model_copy(update={"worker_id": "leaves"})):
            wait_until(lambda: owners(engine, schema)["leaves"] == SHARDS // 2, 15, "a split")
            ids = queue(engine, schema, topic, 6_000, shards=SHARDS)
            with engine.begin() as conn:  # both asleep: wake them, as a publish would
                conn.execute(text("SELECT pg_notify(:channel, '')"),
                             {"channel": store.notify_channel(schema)})
            wait_until(lambda: len(delivered_by(engine, schema)) == 2, 30,
                       "both relays to deliver")
        wait_until(lambda: owners(engine, schema)["stays"] == SHARDS, 5,
                   "the busy relay to take every shard")
        took_over = sum(delivered_by(engine, schema).values())
        wait_delivered(engine, schema, len(ids), timeout=120)
    assert took_over < len(ids) - 1_000, "it was still busy with the backlog"
    seen = assert_per_key_order(engine, schema, settings.kafka_bootstrap, topic)
    assert set(seen) == set(ids)


def delivered_by(engine: Engine, schema: str) -> dict[str, int]:
    """How many messages each relay (worker id) has recorded as delivered."""
    with engine.connect() as conn:
        return dict(conn.execute(text(  # type: ignore[arg-type]
            f"SELECT actor, count(*) FROM {schema}.op_record WHERE action = 'DELIVERED' "
            f"GROUP BY actor")).all())


def test_killed_relay_is_replaced_within_its_lease_and_nothing_is_lost(
    engine: Engine, outbox: Outbox, settings: Settings, schema: str, topic: str
) -> None:
    relays = [start_outbox(settings, "relay", OUTBOX_WORKER_ID=name,
                           OUTBOX_RELAY_LEASE_SECONDS="2") for name in ("doomed", "survivor")]
    logs = ""
    try:
        wait_until(lambda: owners(engine, schema) == Counter(
            {"doomed": SHARDS // 2, "survivor": SHARDS // 2}), 30, "an even split")
        ids = publish_concurrently(engine, outbox, topic, writers=2, transactions=150, keys=40)
        relays[0].kill()
        killed = time.monotonic()
        wait_until(lambda: owners(engine, schema)["survivor"] == SHARDS, 20,
                   "the survivor to take every shard")
        took_over = time.monotonic() - killed
        wait_delivered(engine, schema, len(ids), timeout=60)
    finally:
        for process in relays:
            process.send_signal(signal.SIGTERM)
        for process in relays:
            logs += process.communicate(timeout=30)[0]
    assert took_over < 2 * 3, "a dead relay's shards move once its 2 s leases expire"
    seen = assert_per_key_order(engine, schema, settings.kafka_bootstrap, topic, logs)
    assert set(seen) == set(ids)
