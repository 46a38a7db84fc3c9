"""A small order service on Django: the outbox writes through Django's own connection.

    OUTBOX_DATABASE_URL=postgresql://... python examples/django_service/manage.py migrate
    outbox sweep --app examples.django_service.sweeper:outbox

POST /orders             places an order and publishes OrderPlaced inside transaction.atomic()
POST /orders/<id>/pay    charges a (simulated) gateway with the two-phase API
"""

from __future__ import annotations

import json

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from sqlalchemy import Connection, text

from examples.django_service.orders.models import Order
from outbox import Message, Outbox

outbox = Outbox(producer_group="django-orders")


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    with transaction.atomic():
        order = Order.objects.create(customer=body["customer"], total=body["total"])
        message_id = outbox.publish(
            connection, "orders",
            {"event": "OrderPlaced", "order_id": order.id, "total": str(order.total)},
            key=order.customer, cloudevent_type="com.example.order.placed",
            cloudevent_source="urn:django-orders",
        )
        if body.get("fail"):  # the business transaction fails: nothing is published
            raise ValueError("payment profile missing")
    return JsonResponse({"order_id": order.id, "message_id": message_id}, status=201)


@csrf_exempt
@require_POST
def pay(request: HttpRequest, order_id: int) -> JsonResponse:
    order = get_object_or_404(Order, id=order_id)

    def capture(message: Message) -> str:
        paid = order.id % 2 == 1  # stands in for a payment gateway
        Order.objects.filter(id=order.id).update(state="paid" if paid else "declined")
        return "COMMIT" if paid else "ROLLBACK"

    result = outbox.send_in_transaction(connection, "payments", {"order_id": order.id},
                                        capture, key=order.customer)
    return JsonResponse({"message_id": result.message_id,
                         "resolution": result.resolution.value})


@outbox.checker
def payment_checker(message: Message, conn: Connection) -> str | None:
    """The check-back reads the order's state, as the sweeper's SQLAlchemy connection."""
    state = conn.execute(text("SELECT state FROM orders_order WHERE id = :id"),
                         {"id": message.json()["order_id"]}).scalar()
    return {"paid": "COMMIT", "declined": "ROLLBACK"}.get(state or "")
