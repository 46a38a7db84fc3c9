"""The whole flow on embedded services: orders commit or roll back, the relay delivers.

Run with `make demo`. It starts a throwaway PostgreSQL and Kafka broker, migrates the outbox
schema, starts `outbox relay` and `outbox sweep`, places orders (some transactions roll back,
two hang in a two-phase local transaction and are resolved by the sweeper's check-back),
reads the topic and shows that exactly the committed orders arrived, each with its op record.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    Numeric,
    Table,
    Text,
    create_engine,
    select,
    text,
)
from sqlalchemy.orm import Session

from outbox import Message, Outbox, migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic, read_topic
from outbox.settings import sqlalchemy_url

shop = MetaData(schema="shop")
orders = Table(
    "orders", shop,
    Column("id", Integer, primary_key=True),
    Column("customer", Text, nullable=False),
    Column("total", Numeric(10, 2), nullable=False),
)

CUSTOMERS = ["ada", "grace", "linus", "barbara"]


class PaymentDeclined(Exception):
    pass


class GatewayTimeout(Exception):
    pass


outbox = Outbox(producer_group="shop")


@outbox.checker()
def order_exists(message: Message, conn: Connection) -> str:
    """The check-back (`outbox sweep --app orders_demo:outbox`): is the order there?"""
    order_id = message.json()["order_id"]
    placed = conn.execute(select(orders.c.id).where(orders.c.id == order_id)).first()
    return "COMMIT" if placed else "ROLLBACK"


def step(title: str) -> None:
    print(f"\n== {title}")


def place_order(engine: object, outbox: Outbox, order_id: int, customer: str, total: float,
                declined: bool) -> bool:
    """One business transaction: insert the order and publish its event, atomically."""
    try:
        with Session(engine) as session, session.begin():  # type: ignore[call-overload]
            session.execute(orders.insert().values(id=order_id, customer=customer, total=total))
            outbox.publish(session, "orders", key=customer,
                           payload={"event": "OrderPlaced", "order_id": order_id,
                                    "customer": customer, "total": total})
            if declined:
                raise PaymentDeclined(f"card of {customer} declined")
        return True
    except PaymentDeclined:
        return False


def place_order_two_phase(engine: Engine, order_id: int, customer: str, total: float,
                          saved_before_hang: bool) -> int:
    """RocketMQ style: the prepare row commits first, then the local transaction runs (and
    here hangs on the payment gateway), leaving the message UNKNOWN for the check-back."""
    prepared: list[int] = []

    def local_transaction(message: Message) -> str:
        prepared.append(message.id)
        with Session(engine) as session, session.begin():
            session.execute(orders.insert().values(id=order_id, customer=customer, total=total))
            if not saved_before_hang:
                raise GatewayTimeout("payment gateway did not answer")
        raise GatewayTimeout("payment gateway did not answer")

    with contextlib.suppress(GatewayTimeout):
        outbox.send_in_transaction(engine, "orders", {"event": "OrderPlaced", "order_id": order_id,
                                                      "customer": customer, "total": total},
                                   local_transaction, key=customer,
                                   check_immunity=timedelta(seconds=1))
    return prepared[0]


def main() -> int:
    step("starting a throwaway PostgreSQL and Kafka-protocol broker (outbox dev up)")
    services = devservices.start()
    relay = sweeper = None
    try:
        env = {**os.environ, **services.env()}
        print(f"   OUTBOX_DATABASE_URL={services.database_url}")
        print(f"   OUTBOX_KAFKA_BOOTSTRAP={services.kafka_bootstrap}")

        step("migrating the outbox schema (outbox db upgrade)")
        migrate.upgrade(services.database_url, "outbox")
        engine = create_engine(sqlalchemy_url(services.database_url))
        with engine.begin() as conn:
            conn.execute(text("CREATE SCHEMA shop"))
            shop.create_all(conn)
        create_topic(services.kafka_bootstrap, "orders", partitions=3)
        print("   outbox tables ready; business table shop.orders and topic 'orders' created")

        step("starting the relay (outbox relay)")
        relay = subprocess.Popen([sys.executable, "-m", "outbox", "relay"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        step("starting the check-back sweeper (outbox sweep --app orders_demo:outbox)")
        sweeper = subprocess.Popen(
            [sys.executable, "-m", "outbox", "sweep", "--app", "orders_demo:outbox"],
            env={**env, "PYTHONPATH": str(Path(__file__).parent), "OUTBOX_CHECK_INTERVAL": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        step("placing 10 orders; each inserts its row and publishes in one transaction")
        committed, rolled_back = [], []
        for n in range(1, 11):
            customer = CUSTOMERS[n % len(CUSTOMERS)]
            declined = n in (3, 6, 9)
            ok = place_order(engine, outbox, n, customer, 10.0 * n + 0.5, declined)
            (committed if ok else rolled_back).append(n)
            print(f"   order {n:2} for {customer:8} {'COMMIT' if ok else 'ROLLBACK (declined)'}")

        step("two orders in two phases; the payment gateway hangs, so their outcome is UNKNOWN")
        for n, customer, saved in ((11, "ada", True), (12, "grace", False)):
            message_id = place_order_two_phase(engine, n, customer, 10.0 * n + 0.5, saved)
            (committed if saved else rolled_back).append(n)
            print(f"   order {n:2} for {customer:8} UNKNOWN (message {message_id}; the order row "
                  f"{'was saved' if saved else 'was not saved'}): the sweeper will ask")

        step("waiting for the relay to deliver the committed orders")
        deadline = time.monotonic() + 30
        with engine.connect() as conn:
            while time.monotonic() < deadline:
                delivered = conn.execute(text(
                    "SELECT count(*) FROM outbox.message_state WHERE status = 'DELIVERED'")
                ).scalar_one()
                conn.rollback()
                if delivered >= len(committed):
                    break
                time.sleep(0.1)

        step("reading topic 'orders' back from Kafka")
        records = read_topic(services.kafka_bootstrap, "orders")
        with engine.connect() as conn:
            ops = {row.message_id: row for row in conn.execute(text(
                "SELECT message_id, action, kafka_partition, kafka_offset FROM outbox.op_record"))}
        arrived = []
        for record in sorted(records, key=lambda r: r.message_id or 0):
            event = json.loads(record.value)
            op = ops.get(record.message_id)
            arrived.append(event["order_id"])
            where = f"{op.action} at {op.kafka_partition}/{op.kafka_offset}" if op else "MISSING"
            print(f"   order {event['order_id']:2} key={record.key.decode():8} "
                  f"partition {record.partition} offset {record.offset} | op record: {where}")
        print(f"\n   committed:   {committed}\n   rolled back: {rolled_back}\n"
              f"   in Kafka:    {sorted(arrived)}")
        ok = sorted(arrived) == committed and all(
            r.message_id in ops
            and (ops[r.message_id].kafka_partition, ops[r.message_id].kafka_offset)
            == (r.partition, r.offset) for r in records)
        print("\nOK: exactly the committed orders arrived, once each, where their op records say"
              if ok else "\nFAILED: Kafka does not hold exactly the committed orders")

        step("reconciling tables and topic in Spark (outbox reconcile --read-topics; ~20 s)")
        reconciled = subprocess.run(
            [sys.executable, "-m", "outbox", "reconcile", "--read-topics",
             "--until", datetime.now(UTC).isoformat(),
             "--output-dir", os.path.join(services.root, "reconcile")],
            env=env, capture_output=True, text=True, timeout=600)
        for line in (reconciled.stdout or reconciled.stderr[-2000:]).strip().splitlines():
            print(f"   {line}")
        ok = ok and reconciled.returncode == 0
        engine.dispose()
        return 0 if ok else 1
    finally:
        step("stopping the relay, the sweeper and the embedded services (outbox dev down)")
        for name, daemon in (("relay", relay), ("sweeper", sweeper)):
            if daemon is not None:
                daemon.send_signal(signal.SIGTERM)
                output, _ = daemon.communicate(timeout=30)
                print(f"   {name} log:")
                for line in output.strip().splitlines():
                    print(f"     {line}")
        devservices.stop(services)


if __name__ == "__main__":
    sys.exit(main())
