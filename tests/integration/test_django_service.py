"""Django (psycopg 3): ``outbox.publish(connection, ...)`` inside ``transaction.atomic()``
with Django's own connection, in the example project (settings, a model, ``migrate``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import ConfigurationError, NotInTransaction, Outbox, SchemaNotMigrated, connectors
from outbox.dev.topics import create_topic
from outbox.relay.relay import Relay
from outbox.settings import Settings
from tests.conftest import count_status, delivered_to, wait_delivered, wait_until
from tests.processes import start_outbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def django_project(services: Any) -> Iterator[None]:
    """``manage.py migrate`` for real, then Django set up in this process."""
    env = {**os.environ, "OUTBOX_DATABASE_URL": services.database_url}
    done = subprocess.run([sys.executable, str(ROOT / "examples/django_service/manage.py"),
                           "migrate", "--no-input"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    os.environ.setdefault("OUTBOX_DATABASE_URL", services.database_url)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_service.settings")
    import django

    django.setup()
    yield
    from django.db import connection

    connection.close()


@pytest.fixture
def service(django_project: None, settings: Settings, schema: str,
            monkeypatch: pytest.MonkeyPatch) -> Any:
    from django.test import Client

    from examples.django_service.orders import views

    monkeypatch.setattr(views.outbox, "schema", schema)
    monkeypatch.setattr(views.outbox, "settings", settings)
    for topic in ("orders", "payments"):
        create_topic(settings.kafka_bootstrap, topic)
    return Client(raise_request_exception=False)


def test_orders_publish_in_atomic_and_failed_ones_publish_nothing(
    service: Any, engine: Engine, settings: Settings, schema: str, relay: Relay
) -> None:
    placed = service.post("/orders", {"customer": "ada", "total": "9.50"},
                          content_type="application/json")
    failed = service.post("/orders", {"customer": "bob", "total": "1", "fail": True},
                          content_type="application/json")
    assert (placed.status_code, failed.status_code) == (201, 500)
    paid = service.post(f"/orders/{placed.json()['order_id']}/pay").json()
    assert service.post("/orders/9999/pay").status_code == 404  # as the other examples say
    wait_delivered(engine, schema, 2)
    orders = delivered_to(engine, schema, settings.kafka_bootstrap, "orders")
    assert list(orders) == [placed.json()["message_id"]]
    assert orders[placed.json()["message_id"]].headers["ce_type"] == b"com.example.order.placed"
    assert count_status(engine, schema, "DELIVERED") == 2  # the order and its payment
    assert list(delivered_to(engine, schema, settings.kafka_bootstrap, "payments")) == [
        paid["message_id"]]
    with engine.connect() as conn:
        customers = conn.execute(text("SELECT customer FROM orders_order")).scalars().all()
    assert "bob" not in customers


def test_django_connection_two_phase_and_autocommit(service: Any, settings: Settings,
                                                    engine: Engine, schema: str) -> None:
    from django.db import connection, transaction

    from examples.django_service.orders.views import outbox

    with pytest.raises(NotInTransaction):  # Django's autocommit, outside atomic()
        outbox.publish(connection, "orders", {"n": 1})
    with transaction.atomic():
        first = outbox.prepare(connection, "orders", {"n": 1})
        second = outbox.prepare(connection, "orders", {"n": 2})
        third = outbox.prepare(connection, "orders", {"n": 3})
    outbox.commit(connection, third)  # outside atomic(): at once, as an engine does
    with transaction.atomic():
        outbox.commit(connection, first)
        outbox.rollback(connection, second)
        with pytest.raises(ConfigurationError, match="non_atomic_requests"):  # its way out
            outbox.send_in_transaction(connection, "orders", {"n": 3}, lambda _: "COMMIT")
    with engine.connect() as conn:
        rows = dict(conn.execute(text(f"SELECT id, resolution FROM {schema}.message_state")).all())
    assert rows == {first: "COMMIT", second: "ROLLBACK", third: "COMMIT"}


def test_django_db_connection_is_taken_through_its_proxy(service: Any, engine: Engine,
                                                         schema: str) -> None:
    """``django.db.connection`` is a proxy; from Python 3.12 ``isinstance`` with a protocol
    no longer sees through it, and publishing through it raised ConfigurationError. The
    outbox takes the connection behind it on every Python."""
    from django.db import connection, connections, transaction

    from examples.django_service.orders.views import outbox

    assert type(connection).__name__ == "ConnectionProxy"
    assert connectors.unproxied(connection) is connections["default"]
    with transaction.atomic():
        published = outbox.publish(connection, "orders", {"n": 1})
    sent = outbox.send_in_transaction(connection, "orders", {"n": 2},
                                      lambda _message: "COMMIT")
    with engine.connect() as conn:
        ids = set(conn.execute(text(f"SELECT id FROM {schema}.message")).scalars())
    assert {published, sent.message_id} <= ids


def test_an_unmigrated_schema_says_which_command_to_run(django_project: None,
                                                        settings: Settings) -> None:
    from django.db import connection, transaction

    missing = Outbox(settings=settings, schema=f"missing_{uuid.uuid4().hex[:8]}")
    with pytest.raises(SchemaNotMigrated, match=r"outbox --schema missing_\w+ db upgrade"), \
            transaction.atomic():
        missing.publish(connection, "orders", {"n": 1})


def test_the_sweeper_runs_the_example_checker(django_project: None, settings: Settings,
                                              engine: Engine, schema: str) -> None:
    """The command the example's docstring gives: the sweeper imports the app before Django
    is set up (importing the views alone raised AppRegistryNotReady)."""
    from examples.django_service.orders.models import Order

    order = Order.objects.create(customer="ada", total="9.50", state="paid")
    fast = settings.model_copy(update={"transaction_timeout": 0.2})
    with Session(engine) as session, session.begin():
        message_id = Outbox(settings=fast, producer_group="django-orders").prepare(
            session, "payments", {"order_id": order.id})
    sweeper = start_outbox(fast, "sweep", "--app", "examples.django_service.sweeper:outbox",
                           "--check-interval", "0.1", OUTBOX_SWEEP_POLL_INTERVAL="0.1")
    try:
        wait_until(lambda: resolution(engine, schema, message_id) == "COMMIT", 30,
                   "the example's checker to commit the payment")
    finally:
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    assert "checkers for django-orders" in output


def resolution(engine: Engine, schema: str, message_id: int) -> str:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT resolution FROM {schema}.message_state WHERE id = :id"),
                            {"id": message_id}).scalar_one()
