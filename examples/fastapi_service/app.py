"""A small order service: FastAPI, an async SQLAlchemy session, the outbox, and a checker.

    OUTBOX_DATABASE_URL=postgresql://... uvicorn examples.fastapi_service.app:app
    outbox sweep --app examples.fastapi_service.app:outbox     # answers check-backs

POST /orders         places an order and publishes OrderPlaced in the same transaction.
POST /orders/{id}/pay  charges a (simulated) payment gateway outside the database with the
                     two-phase API: the PaymentCaptured event is prepared first, then
                     committed or rolled back with the charge's outcome; if the service dies
                     in between, the sweeper asks `payment_checker`, which reads the order.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy import Column, Connection, Integer, MetaData, Numeric, Table, Text, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.schema import CreateSchema

from outbox import Message, Outbox
from outbox.settings import sqlalchemy_url

shop = MetaData(schema=os.environ.get("SHOP_SCHEMA", "shop"))
orders = Table(
    "orders", shop,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("customer", Text, nullable=False),
    Column("total", Numeric(10, 2), nullable=False),
    Column("state", Text, nullable=False, server_default="placed"),
)

outbox = Outbox(producer_group="order-service")
engine: AsyncEngine | None = None


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    global engine
    engine = create_async_engine(sqlalchemy_url(os.environ["OUTBOX_DATABASE_URL"]))
    async with engine.begin() as conn:  # the example's own table; a real service migrates
        await conn.execute(CreateSchema(str(shop.schema), if_not_exists=True))
        await conn.run_sync(shop.create_all)
    yield
    await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


class NewOrder(BaseModel):
    customer: str
    total: Decimal


@app.post("/orders", status_code=201)
async def place_order(order: NewOrder) -> dict[str, int]:
    assert engine is not None
    async with AsyncSession(engine) as session, session.begin():
        order_id = (await session.execute(
            orders.insert().values(customer=order.customer, total=order.total)
            .returning(orders.c.id))).scalar_one()
        message_id = await outbox.publish(
            session, "orders",
            {"event": "OrderPlaced", "order_id": order_id, "customer": order.customer,
             "total": str(order.total)},
            key=order.customer,
        )
    return {"order_id": order_id, "message_id": message_id}


def charge_card(order_id: int) -> bool:
    """Stands in for a payment gateway: orders with an even id are declined."""
    return order_id % 2 == 1


@app.post("/orders/{order_id}/pay")
async def pay(order_id: int) -> dict[str, object]:
    assert engine is not None

    async def capture(message: Message) -> str:
        paid = charge_card(order_id)
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(orders.update().where(orders.c.id == order_id)
                                  .values(state="paid" if paid else "declined"))
        return "COMMIT" if paid else "ROLLBACK"

    async with AsyncSession(engine) as session:
        customer = (await session.execute(
            select(orders.c.customer).where(orders.c.id == order_id))).scalar()
    if customer is None:
        raise HTTPException(404, f"no order {order_id}")
    result = await outbox.send_in_transaction(
        engine, "payments", {"event": "PaymentCaptured", "order_id": order_id}, capture,
        key=customer,
    )
    return {"message_id": result.message_id, "resolution": result.resolution.value}


@outbox.checker()
def payment_checker(message: Message, conn: Connection) -> str | None:
    """The check-back: the order's state says whether the payment went through."""
    state = conn.execute(select(orders.c.state)
                         .where(orders.c.id == message.json()["order_id"])).scalar()
    return {"paid": "COMMIT", "declined": "ROLLBACK"}.get(state or "")
