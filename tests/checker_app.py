"""An application module for `outbox sweep --app tests.checker_app:outbox` in the tests."""

from __future__ import annotations

import threading

from sqlalchemy import Connection, text

from outbox import Message, Outbox

outbox = Outbox(producer_group="cli-orders")


@outbox.checker()
def order_was_placed(message: Message, conn: Connection) -> str:
    """Every order of this test application was placed: its messages commit."""
    return "COMMIT"


#: A checker that never answers, as one calling a service without a timeout would, once it
#: has read its database (its session shows the check in hand):
#: `outbox sweep --app tests.checker_app:stuck`.
stuck = Outbox(producer_group="stuck-orders")


@stuck.checker()
def never_answers(message: Message, conn: Connection) -> str:
    conn.execute(text("SELECT 1"))
    threading.Event().wait()
    return "COMMIT"
