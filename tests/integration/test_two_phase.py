"""Two-phase messages: prepare, local transaction, COMMIT / ROLLBACK / UNKNOWN (docs/guarantees.md).

The check-back of messages left UNKNOWN is proven in test_sweeper.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, Row, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox import (
    DecisionConflict,
    InvalidMessage,
    Message,
    MessageNotFound,
    Outbox,
    Resolution,
    TransactionResult,
)
from outbox.dev.topics import read_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import publish_orders, running_relay, wait_delivered, wait_until


class PaymentTimeout(Exception):
    pass


def message_row(engine: Engine, schema: str, message_id: int) -> Row[tuple[str, str, int, float]]:
    with engine.connect() as conn:
        return conn.execute(text(
            f"SELECT resolution, status, check_count, "
            f"extract(epoch FROM next_check_at - created_at) AS check_after "
            f"FROM {schema}.message_state WHERE id = :id"), {"id": message_id}).one()


def op_actions(engine: Engine, schema: str, message_id: int) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(text(
            f"SELECT action, actor FROM {schema}.op_record WHERE message_id = :id ORDER BY id"),
            {"id": message_id})]


def prepare(engine: Engine, outbox: Outbox, topic: str, payload: object, key: str | None = None,
            **kwargs: object) -> int:
    with Session(engine) as session, session.begin():
        return outbox.prepare(session, topic, payload, key=key, **kwargs)  # type: ignore[arg-type]


def delivered_ids(settings: Settings, topic: str) -> list[int | None]:
    return [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)]


def test_local_transaction_answering_commit_is_delivered(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    seen: list[Message] = []

    def local_transaction(message: Message) -> Resolution:
        seen.append(message)
        return Resolution.COMMIT

    result = outbox.send_in_transaction(engine, topic, {"order": 1}, local_transaction, key="a")

    assert result == TransactionResult(seen[0].id, Resolution.COMMIT)
    assert (seen[0].json(), seen[0].key, seen[0].topic) == ({"order": 1}, b"a", topic)
    wait_delivered(engine, schema, 1)
    assert delivered_ids(settings, topic) == [result.message_id]


def test_local_transaction_answering_rollback_is_never_delivered(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    rolled_back = outbox.send_in_transaction(engine, topic, {"n": 1}, lambda m: "ROLLBACK",
                                             key="a")
    committed = outbox.send_in_transaction(engine, topic, {"n": 2}, lambda m: "COMMIT", key="a")
    wait_delivered(engine, schema, 1)

    assert delivered_ids(settings, topic) == [committed.message_id]
    assert message_row(engine, schema, rolled_back.message_id).status == "ROLLED_BACK"
    assert op_actions(engine, schema, rolled_back.message_id) == [
        ("ROLLED_BACK", f"app:{settings.worker_id}")]


def test_a_check_back_that_resolved_the_message_during_the_local_transaction_is_said_so(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    """A local transaction longer than the transaction timeout meets its check-back: a
    checker that cannot see its effect yet answers ROLLBACK. The DecisionConflict that
    followed carried the note "stays UNKNOWN until its check-back resolves it", where the
    message was rolled back for good."""
    def slow_charge(message: Message) -> str:
        outbox.rollback(engine, message.id)  # the check-back, answered meanwhile
        return "COMMIT"

    with pytest.raises(DecisionConflict) as caught:
        outbox.send_in_transaction(engine, "orders", {"n": 1}, slow_charge)

    message_id = int(str(caught.value).split()[1])
    assert message_row(engine, schema, message_id).status == "ROLLED_BACK"
    assert caught.value.__notes__ == [
        f"outbox message {message_id} was resolved while the local transaction ran (by its "
        "check-back, if the local transaction outlasted transaction_timeout or its "
        "check_immunity)"]


def test_local_transaction_that_raises_leaves_the_message_unknown_for_the_check_back(
    engine: Engine, outbox: Outbox, schema: str, settings: Settings
) -> None:
    prepared: list[int] = []

    def local_transaction(message: Message) -> Resolution:
        prepared.append(message.id)
        raise PaymentTimeout("the payment service did not answer")

    with pytest.raises(PaymentTimeout) as caught:
        outbox.send_in_transaction(engine, "orders", {"n": 1}, local_transaction)

    assert caught.value.__notes__ == [
        f"outbox message {prepared[0]} stays UNKNOWN until its check-back resolves it"]
    row = message_row(engine, schema, prepared[0])
    assert (row.resolution, row.status, row.check_count) == ("UNKNOWN", "PENDING", 0)
    assert row.check_after == pytest.approx(settings.transaction_timeout)


def test_local_transaction_without_an_answer_leaves_the_message_unknown(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    result = outbox.send_in_transaction(engine, "orders", {"n": 1}, lambda m: None)

    assert result.resolution is Resolution.UNKNOWN
    assert message_row(engine, schema, result.message_id).resolution == "UNKNOWN"


def test_local_transaction_with_a_meaningless_answer_is_a_bug_and_stays_unknown(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    with pytest.raises(TypeError, match="answered a value of type int; answer COMMIT"):
        outbox.send_in_transaction(engine, "orders", {"n": 1}, lambda m: 42)  # type: ignore[arg-type,return-value]
    with engine.connect() as conn:
        resolutions = conn.execute(text(f"SELECT resolution FROM {schema}.message_state")).scalars()
        assert list(resolutions) == ["UNKNOWN"]


def test_check_immunity_sets_when_the_first_check_back_is_due(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    message_id = prepare(engine, outbox, "orders", "x", check_immunity=timedelta(minutes=10))
    assert message_row(engine, schema, message_id).check_after == 600


def test_prepared_message_waits_for_its_commit_and_holds_back_its_key(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    held = prepare(engine, outbox, topic, {"n": 1}, key="k")
    behind = publish_orders(engine, outbox, topic, [("k", 2)])[0]
    other = publish_orders(engine, outbox, topic, [("other", 3)])[0]
    wait_delivered(engine, schema, 1)
    assert delivered_ids(settings, topic) == [other]

    outbox.commit(engine, held)
    wait_delivered(engine, schema, 3)
    by_key = [r.message_id for r in read_topic(settings.kafka_bootstrap, topic) if r.key == b"k"]
    assert by_key == [held, behind]


def test_prepared_message_rolled_back_by_id_is_never_delivered_and_releases_its_key(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    held = prepare(engine, outbox, topic, {"n": 1}, key="k")
    behind = publish_orders(engine, outbox, topic, [("k", 2)])[0]

    outbox.rollback(engine, held)
    wait_delivered(engine, schema, 1)
    assert delivered_ids(settings, topic) == [behind]
    assert op_actions(engine, schema, held) == [("ROLLED_BACK", f"app:{settings.worker_id}")]


def test_prepare_rolled_back_with_the_business_transaction_leaves_nothing(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    with Session(engine) as session:
        session.begin()
        message_id = outbox.prepare(session, "orders", {"n": 1})
        session.rollback()

    with pytest.raises(MessageNotFound, match=f"no message {message_id}"):
        outbox.commit(engine, message_id)


def test_a_decision_through_another_connection_before_the_prepare_commits_says_why(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    """It said only "no message N", as for an id never written."""
    with Session(engine) as session, session.begin():
        message_id = outbox.prepare(session, "orders", {"n": 1})
        with pytest.raises(MessageNotFound, match=f"no message {message_id} in outbox schema "
                           f"'{schema}': .*or not committed yet"):
            outbox.commit(engine, message_id)
        outbox.commit(session, message_id)  # the same transaction sees its own row
    assert message_row(engine, schema, message_id).resolution == "COMMIT"


class Id:
    """An integer type of some other library (numpy's, for one): it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_a_decision_names_its_message_by_an_integer_id(engine: Engine, outbox: Outbox,
                                                       schema: str) -> None:
    """An id read back as a float or a bool was sent as one, and PostgreSQL's "no such
    function" was taken for an unmigrated schema: the error said to run `outbox db upgrade`."""
    message_id = prepare(engine, outbox, "orders", {"n": 1})
    for wrong in (float(message_id), True, str(message_id), None):
        with pytest.raises(InvalidMessage, match="message_id must be an integer"):
            outbox.commit(engine, wrong)  # type: ignore[arg-type]
    with pytest.raises(MessageNotFound, match=f"no message {2**70}"):
        outbox.rollback(engine, 2**70)
    outbox.commit(engine, Id(message_id))  # type: ignore[arg-type]
    assert message_row(engine, schema, message_id).resolution == "COMMIT"


def test_a_decision_in_the_callers_transaction_shares_its_fate(
    engine: Engine, outbox: Outbox, schema: str
) -> None:
    message_id = prepare(engine, outbox, "orders", {"n": 1})
    with Session(engine) as session:
        session.begin()
        outbox.commit(session, message_id)
        session.rollback()
    assert message_row(engine, schema, message_id).resolution == "UNKNOWN"

    with Session(engine) as session, session.begin():
        outbox.commit(session, message_id)
    assert message_row(engine, schema, message_id).resolution == "COMMIT"


@pytest.mark.parametrize("decision", ["commit", "rollback"])
def test_deciding_again_the_same_way_changes_nothing(
    engine: Engine, outbox: Outbox, schema: str, decision: str
) -> None:
    message_id = prepare(engine, outbox, "orders", {"n": 1})
    getattr(outbox, decision)(engine, message_id)
    getattr(outbox, decision)(engine, message_id)
    assert len(op_actions(engine, schema, message_id)) == (decision == "rollback")


@pytest.mark.parametrize(("first", "second", "resolved"),
                         [("commit", "rollback", "COMMIT"), ("rollback", "commit", "ROLLBACK")])
def test_a_conflicting_second_decision_is_refused(
    engine: Engine, outbox: Outbox, schema: str, first: str, second: str, resolved: str
) -> None:
    message_id = prepare(engine, outbox, "orders", {"n": 1})
    getattr(outbox, first)(engine, message_id)

    with pytest.raises(DecisionConflict,
                       match=f"message {message_id} is already resolved {resolved}"):
        getattr(outbox, second)(engine, message_id)
    assert message_row(engine, schema, message_id).resolution == resolved


def test_a_decision_wakes_the_relay_without_waiting_for_a_poll(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    held = prepare(engine, outbox, topic, {"n": 1})
    slow_poll = settings.model_copy(update={"relay_poll_interval": 30.0})
    daemon = Relay(slow_poll)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        publish_orders(engine, outbox, topic, [("k", 1)])
        wait_delivered(engine, schema, 1, timeout=20)  # the relay is up and idle
        outbox.commit(engine, held)
        wait_delivered(engine, schema, 2, timeout=10)
    finally:
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_rollback_wakes_the_relay_for_the_messages_of_its_key(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings
) -> None:
    """A prepared message holds back the later messages of its key. Rolled back, it frees
    them, but only a commit notified: they waited for the relay's next poll (here 30 s)."""
    held = prepare(engine, outbox, topic, {"n": 1}, key="k")
    with running_relay(settings.model_copy(update={"relay_poll_interval": 30.0})):
        publish_orders(engine, outbox, topic, [("k", 1), ("other", 2)])
        wait_delivered(engine, schema, 1, timeout=20)  # the relay is up, "k" held back
        outbox.rollback(engine, held)
        wait_delivered(engine, schema, 2, timeout=10)


def test_async_two_phase_shares_the_sync_behaviour(
    engine: Engine, outbox: Outbox, topic: str, schema: str, settings: Settings, relay: Relay
) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        async_engine = create_async_engine(sqlalchemy_url(settings.database_url))

        async def pay(message: Message) -> str:
            await asyncio.sleep(0)
            return "COMMIT"

        try:
            sent = await outbox.send_in_transaction(async_engine, topic, {"n": 1}, pay, key="a")
            declined = await outbox.send_in_transaction(
                async_engine, topic, {"n": 2}, lambda m: Resolution.ROLLBACK, key="a")
            async with AsyncSession(async_engine) as session, session.begin():
                later = await outbox.prepare(session, topic, {"n": 3}, key="a")
            async with AsyncSession(async_engine) as session, session.begin():
                await outbox.commit(session, later)
            async with async_engine.connect() as conn:
                await conn.begin()
                dropped = await outbox.prepare(conn, topic, {"n": 4}, key="a")
                await conn.commit()
            await outbox.rollback(async_engine, dropped)
            with pytest.raises(DecisionConflict):
                await outbox.commit(async_engine, dropped)
            return [sent.message_id, later], [declined.message_id, dropped]
        finally:
            await async_engine.dispose()

    committed, rolled_back = asyncio.run(scenario())
    wait_delivered(engine, schema, 2)
    assert delivered_ids(settings, topic) == committed
    assert {message_row(engine, schema, i).status for i in rolled_back} == {"ROLLED_BACK"}


def waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()")).scalar_one())


@pytest.mark.parametrize(("second", "refused"), [("commit", True), ("rollback", False)])
def test_a_decision_that_waited_for_a_rollback_answers_what_it_found(
    engine: Engine, outbox: Outbox, schema: str, second: str, refused: bool
) -> None:
    """A decision waiting behind another transaction's ROLLBACK (which deletes the pending row)
    read the op records with its snapshot from before the wait: a COMMIT returned as if it
    had committed (the message never to be delivered), a second ROLLBACK raised
    DecisionConflict naming COMMIT."""
    message_id = prepare(engine, outbox, "orders", {"n": 1})
    outcome: list[str] = []

    def decide() -> None:
        try:
            getattr(outbox, second)(engine, message_id)
            outcome.append("done")
        except DecisionConflict as exc:
            outcome.append(str(exc))

    waiting = threading.Thread(target=decide)
    with Session(engine) as first, first.begin():
        outbox.rollback(first, message_id)
        waiting.start()
        wait_until(lambda: waiting_on_a_lock(engine), 10, "the second decision to wait")
    waiting.join(10)
    assert len(outcome) == 1 and outcome[0].startswith(
        f"message {message_id} is already resolved ROLLBACK") if refused else outcome == ["done"]
    assert message_row(engine, schema, message_id).status == "ROLLED_BACK"


def test_a_decision_left_open_on_a_decided_message_stalls_no_delivery(
    engine: Engine, outbox: Outbox, schema: str, topic: str, settings: Settings
) -> None:
    """Deciding again the same way changes nothing, yet it locked the row until the
    application's transaction ended: the relay sent the message, then waited to record it,
    with every batch after it (no timeout; a relay killed meanwhile had sent them unrecorded)."""
    decided = prepare(engine, outbox, topic, {"n": 0}, key="a")
    outbox.commit(engine, decided)
    with Session(engine) as application, application.begin():
        outbox.commit(application, decided)  # again, in a transaction left open
        others = publish_orders(engine, outbox, topic, [(f"k{n}", n) for n in range(1, 20)])
        with running_relay(settings):
            wait_delivered(engine, schema, 1 + len(others), timeout=30)
    assert sorted(delivered_ids(settings, topic)) == [decided, *others]


def test_a_delayed_message_decided_in_an_open_transaction_stalls_no_other_delivery(
    engine: Engine, outbox: Outbox, schema: str, topic: str, settings: Settings
) -> None:
    """The relay's promotion of due delayed rows waited for the row lock of a decision in a
    transaction still open, and with it the relay's whole loop: no shard delivered."""
    delayed = prepare(engine, outbox, topic, {"n": 0}, key="a",
                      deliver_after=timedelta(seconds=1))
    with running_relay(settings):
        with Session(engine) as application, application.begin():
            outbox.commit(application, delayed)
            time.sleep(1.5)  # due now, its row locked by the open decision
            others = publish_orders(engine, outbox, topic, [(f"k{n}", n) for n in range(1, 20)])
            wait_delivered(engine, schema, len(others), timeout=30)
        wait_delivered(engine, schema, 1 + len(others), timeout=30)
    assert sorted(delivered_ids(settings, topic)) == [delayed, *others]
