"""The FastAPI example service publishes through the async session, and its checker answers
the sweeper for a payment whose decision never arrived."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox.dev.topics import create_topic
from outbox.relay.relay import Relay
from outbox.relay.sweeper import Sweeper, load_app
from outbox.settings import Settings
from tests.conftest import count_status, delivered_to, wait_delivered, wait_until


@pytest.fixture
def service(engine: Engine, settings: Settings, schema: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", settings.database_url)
    from examples.fastapi_service import app as service_module

    monkeypatch.setattr(service_module.outbox, "schema", schema)
    monkeypatch.setattr(service_module.outbox, "settings", settings)
    for topic in ("orders", "payments"):
        create_topic(settings.kafka_bootstrap, topic)
    with TestClient(service_module.app) as client:  # its start makes its table
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE shop.orders RESTART IDENTITY"))
        yield client


def test_orders_are_published_and_payments_are_two_phase(
    service: TestClient, engine: Engine, settings: Settings, schema: str, relay: Relay
) -> None:
    placed = [service.post("/orders", json={"customer": c, "total": "9.50"}).json()
              for c in ("ada", "grace")]
    assert [p["order_id"] for p in placed] == [1, 2]
    paid = service.post("/orders/1/pay").json()
    declined = service.post("/orders/2/pay").json()
    assert (paid["resolution"], declined["resolution"]) == ("COMMIT", "ROLLBACK")
    assert service.post("/orders/99/pay").status_code == 404
    wait_delivered(engine, schema, 3)
    in_orders = delivered_to(engine, schema, settings.kafka_bootstrap, "orders")
    in_payments = delivered_to(engine, schema, settings.kafka_bootstrap, "payments")
    assert sorted(in_orders) == sorted(p["message_id"] for p in placed)
    assert list(in_payments) == [paid["message_id"]]
    assert declined["message_id"] not in in_payments
    assert count_status(engine, schema, "ROLLED_BACK") == 1


def test_the_example_checker_resolves_a_lost_decision(
    service: TestClient, engine: Engine, settings: Settings, schema: str
) -> None:
    from outbox import Outbox

    order_id = service.post("/orders", json={"customer": "linus", "total": "3"}).json()[
        "order_id"]
    with engine.begin() as conn:
        conn.execute(text("UPDATE shop.orders SET state = 'paid' WHERE id = :id"),
                     {"id": order_id})
    example = load_app("examples.fastapi_service.app:outbox")
    prepared = Outbox(settings=settings, producer_group="order-service")
    with Session(engine) as session, session.begin():  # prepared, then the service "died"
        message_id = prepared.prepare(session, "payments", {"order_id": order_id},
                                      key="linus")
    fast = settings.model_copy(update={"check_interval": 0.2, "transaction_timeout": 0})
    sweeper = Sweeper(fast, example.checkers)
    thread = threading.Thread(target=sweeper.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: _resolution(engine, schema, message_id) == "COMMIT", 20,
                   "the checker to answer COMMIT")
    finally:
        sweeper.stop()
        thread.join(10)


def _resolution(engine: Engine, schema: str, message_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text(
            f"SELECT resolution FROM {schema}.message_state WHERE id = :id"), {"id": message_id}
        ).scalar_one())
