"""The whole flow on embedded services: orders commit or roll back, the relay delivers.

Run with `make demo`. It starts a throwaway PostgreSQL and Kafka broker, migrates the outbox
schema, starts `outbox relay`, places orders (some transactions roll back), reads the topic
and shows that exactly the committed orders arrived, each with its op record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from sqlalchemy import Column, Integer, MetaData, Numeric, Table, Text, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox, devservices, migrate
from outbox.settings import sqlalchemy_url
from outbox.topic_reader import create_topic, read_topic

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


def main() -> int:
    step("starting a throwaway PostgreSQL and Kafka-protocol broker (outbox dev up)")
    services = devservices.start()
    relay = None
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

        step("placing 10 orders; each inserts its row and publishes in one transaction")
        outbox = Outbox()
        committed, rolled_back = [], []
        for n in range(1, 11):
            customer = CUSTOMERS[n % len(CUSTOMERS)]
            declined = n in (3, 6, 9)
            ok = place_order(engine, outbox, n, customer, 10.0 * n + 0.5, declined)
            (committed if ok else rolled_back).append(n)
            print(f"   order {n:2} for {customer:8} {'COMMIT' if ok else 'ROLLBACK (declined)'}")

        step("waiting for the relay to deliver the committed orders")
        deadline = time.monotonic() + 30
        with engine.connect() as conn:
            while time.monotonic() < deadline:
                delivered = conn.execute(text(
                    "SELECT count(*) FROM outbox.message WHERE status = 'DELIVERED'")
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
        engine.dispose()
        return 0 if ok else 1
    finally:
        step("stopping the relay and the embedded services (outbox dev down)")
        if relay is not None:
            relay.send_signal(signal.SIGTERM)
            output, _ = relay.communicate(timeout=30)
            print("   relay log:")
            for line in output.strip().splitlines():
                print(f"     {line}")
        devservices.stop(services)


if __name__ == "__main__":
    sys.exit(main())
