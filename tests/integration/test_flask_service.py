"""Flask-SQLAlchemy: the example service publishes through ``db.session`` (a scoped session)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine

from outbox import NotInTransaction, Outbox, SchemaNotMigrated
from outbox.dev.topics import create_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import count_status, delivered_to, wait_delivered


@pytest.fixture
def app(settings: Settings, schema: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from examples.flask_service import app as service

    monkeypatch.setattr(service.outbox, "schema", schema)
    monkeypatch.setattr(service.outbox, "settings", settings)
    flask_app = service.create_app(settings.database_url)  # makes its table
    for topic in ("orders", "payments"):
        create_topic(settings.kafka_bootstrap, topic)
    yield flask_app
    with flask_app.app_context():
        service.db.engine.dispose()


@pytest.fixture
def client(app: object) -> FlaskClient:
    return app.test_client()  # type: ignore[attr-defined, no-any-return]


def test_db_session_publishes_and_rolls_back(client: FlaskClient, engine: Engine,
                                             settings: Settings, schema: str,
                                             relay: Relay) -> None:
    placed = client.post("/orders", json={"customer": "ada", "total": "9.50"})
    failed = client.post("/orders", json={"customer": "bob", "total": "1", "fail": True})
    assert (placed.status_code, failed.status_code) == (201, 422)
    paid = client.post(f"/orders/{placed.json['order_id']}/pay").json  # type: ignore[index]
    assert paid is not None and paid["resolution"] == "COMMIT"
    wait_delivered(engine, schema, 2)
    assert placed.json is not None
    assert list(delivered_to(engine, schema, settings.kafka_bootstrap, "orders")) == [
        placed.json["message_id"]]
    assert list(delivered_to(engine, schema, settings.kafka_bootstrap, "payments")) == [
        paid["message_id"]]
    assert count_status(engine, schema, "DELIVERED") == 2


def test_db_session_two_phase_and_errors(app: object, engine: Engine, settings: Settings,
                                         schema: str) -> None:
    from examples.flask_service.app import db, outbox

    with app.app_context():  # type: ignore[attr-defined]
        with pytest.raises(NotInTransaction):  # db.session has not begun anything yet
            outbox.publish(db.session, "orders", {"n": 1})
        with db.session.begin():
            first = outbox.prepare(db.session, "orders", {"n": 1})
            second = outbox.prepare(db.session, "orders", {"n": 2})
        with db.session.begin():
            outbox.commit(db.session, first)
            outbox.rollback(db.session, second)
        missing = Outbox(settings=settings, schema=f"missing_{uuid.uuid4().hex[:8]}")
        with pytest.raises(SchemaNotMigrated, match=r"outbox --schema missing_\w+ db upgrade"), \
                db.session.begin():
            missing.publish(db.session, "orders", {"n": 1})
    assert count_status(engine, schema, "ROLLED_BACK") == 1
    assert count_status(engine, schema, "PENDING") == 1
