"""What a step of the relay's topic holds changes is written in one transaction
(relay/holds.py's ``_write``): if it fails, the next step writes it. Here a real lock timeout
fails it: another session holds the outbox table while the step runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from outbox import Outbox
from outbox.relay import holds
from outbox.schema import SHARDS
from outbox.settings import Settings
from tests.conftest import publish_orders
from tests.integration.test_topic_hold import HELD, held_flags, held_marks


@contextmanager
def table_locked(engine: Engine, schema: str) -> Iterator[None]:
    """Another session holds the outbox table: no row of it can be written meanwhile."""
    with engine.connect() as locker, locker.begin():
        locker.execute(text(f"LOCK TABLE {schema}.pending IN EXCLUSIVE MODE"))
        yield


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
    with engine.connect() as conn:
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
