"""Two live relays never share a worker id: the second is refused with one line, and a dead
one's id is free again at once (issue: twin relays delivered 2,980 of 3,000 messages twice)."""

from __future__ import annotations

import signal

from sqlalchemy import Engine, text

from outbox import Outbox, store
from outbox.relay.leases import WorkerIdentity
from outbox.settings import Settings
from tests.conftest import publish_orders, wait_delivered, wait_until
from tests.processes import start_outbox


def test_a_second_relay_with_a_worker_id_in_use_is_refused(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    first = start_outbox(settings, "relay", OUTBOX_WORKER_ID="relay-1")
    try:
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1)
        twin = start_outbox(settings, "relay", OUTBOX_WORKER_ID="relay-1")
        try:
            output, _ = twin.communicate(timeout=30)
        finally:
            twin.kill()  # a twin that is not refused must not outlive the test
        assert twin.returncode == 2, output
        assert output.startswith("outbox: error: ") and output.count("\n") == 1, output
        assert "relay-1" in output and "OUTBOX_WORKER_ID" in output
        assert first.poll() is None, "the first relay keeps running"
    finally:
        first.kill()
        first.wait(10)


def test_the_worker_id_of_a_relay_killed_with_sigkill_is_free_again(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    first = start_outbox(settings, "relay", OUTBOX_WORKER_ID="relay-1")
    wait_until(lambda: _owned_shards(engine, schema) > 0, 30, "the first relay to own shards")
    first.kill()
    first.wait(10)
    restarted = start_outbox(settings, "relay", OUTBOX_WORKER_ID="relay-1")
    try:
        publish_orders(engine, outbox, topic, [("k", 2)])
        wait_delivered(engine, schema, 1, timeout=60)
        assert restarted.poll() is None
    finally:
        restarted.send_signal(signal.SIGTERM)
        output, _ = restarted.communicate(timeout=30)
    assert restarted.returncode == 0, output


def _owned_shards(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT count(*) FROM {schema}.relay_lease WHERE owner IS NOT NULL")).scalar_one())


def test_a_worker_id_let_go_is_free_at_once_for_the_next_relay(
    engine: Engine, settings: Settings
) -> None:
    """A relay stopped and started again in one process (or restarted at once with a fixed
    OUTBOX_WORKER_ID) was refused now and then as its own twin: its lock went with its
    session, whose backend exits a moment after the connection closes (a busy server's
    moment is longer). A relay lets go of its worker id before it returns."""
    schema, worker_id = settings.schema_name, settings.worker_id
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as next_one:
        for _ in range(200):
            identity = WorkerIdentity(settings)
            identity.hold()
            identity.release()
            assert store.claim_worker_id(next_one, schema, worker_id), "still held"
            store.release_worker_id(next_one, schema, worker_id)
