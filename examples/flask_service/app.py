"""A small order service on Flask and Flask-SQLAlchemy: publish through ``db.session``.

    OUTBOX_DATABASE_URL=postgresql://... flask --app examples.flask_service.app run
    outbox sweep --app examples.flask_service.app:outbox

POST /orders             places an order and publishes OrderPlaced in the same transaction
POST /orders/<id>/pay    charges a (simulated) gateway with the two-phase API
"""

from __future__ import annotations

import os
from decimal import Decimal

from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import Connection, Numeric, Text, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import Message, Outbox
from outbox.settings import sqlalchemy_url


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
outbox = Outbox(producer_group="flask-orders")


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(Text)
    total: Mapped[Decimal] = mapped_column(Numeric(10, 2))
    state: Mapped[str] = mapped_column(Text, default="placed")


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sqlalchemy_url(
        database_url or os.environ["OUTBOX_DATABASE_URL"])
    db.init_app(app)
    with app.app_context():
        db.create_all()  # the example's own table; a real service migrates its schema

    @app.post("/orders")
    def place_order() -> tuple[dict[str, int], int]:
        body = request.get_json()
        order = Order(customer=body["customer"], total=Decimal(body["total"]))
        db.session.add(order)
        db.session.flush()  # the order's id; db.session's transaction is now open
        message_id = outbox.publish(db.session, "orders",
                                    {"event": "OrderPlaced", "order_id": order.id},
                                    key=order.customer)
        if body.get("fail"):
            db.session.rollback()  # nothing is published
            abort(422)
        db.session.commit()
        return {"order_id": order.id, "message_id": message_id}, 201

    @app.post("/orders/<int:order_id>/pay")
    def pay(order_id: int) -> dict[str, object]:
        order = db.get_or_404(Order, order_id)

        def capture(message: Message) -> str:
            order.state = "paid" if order.id % 2 == 1 else "declined"  # a stand-in gateway
            db.session.commit()
            return "COMMIT" if order.state == "paid" else "ROLLBACK"

        customer = order.customer
        db.session.commit()  # send_in_transaction commits its prepare row on its own
        result = outbox.send_in_transaction(db.engine, "payments", {"order_id": order_id},
                                            capture, key=customer)
        return {"message_id": result.message_id, "resolution": result.resolution.value}

    return app


@outbox.checker
def payment_checker(message: Message, conn: Connection) -> str | None:
    state = conn.execute(select(Order.state)
                         .where(Order.id == message.json()["order_id"])).scalar()
    return {"paid": "COMMIT", "declined": "ROLLBACK"}.get(state or "")
