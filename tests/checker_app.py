"""An application module for `outbox sweep --app tests.checker_app:outbox` in the tests."""

from __future__ import annotations

from sqlalchemy import Connection

from outbox import Message, Outbox

outbox = Outbox(producer_group="cli-orders")


@outbox.checker()
def order_was_placed(message: Message, conn: Connection) -> str:
    """Every order of this test application was placed: its messages commit."""
    return "COMMIT"
