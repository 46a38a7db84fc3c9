"""Development and test helpers: the embedded PostgreSQL and broker (``outbox dev up``) and a
topic reader. Never loaded by ``import outbox``; applications do not need them."""
