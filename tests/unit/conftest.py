"""The unit tier runs without PostgreSQL or a broker, and without the caller's OUTBOX_* shell."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NoReturn

import pytest
from sqlalchemy import Engine, create_engine


@pytest.fixture(scope="session")
def services() -> NoReturn:
    """Guard: a unit test that needs the real services belongs in tests/integration."""
    pytest.fail("unit tests start no PostgreSQL or broker: move this test to tests/integration")


@pytest.fixture(autouse=True)
def clean_environment() -> Iterator[None]:
    """No OUTBOX_* variable leaks in from the shell, and whatever a test sets is undone."""
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.upper().startswith("OUTBOX_")]:
        del os.environ[name]
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def connections() -> list[str]:
    """Every connection the ``engine`` fixture was asked for (none, for rejected input)."""
    return []


@pytest.fixture
def engine(connections: list[str]) -> Engine:
    """An engine that counts the connections asked of it and refuses them all: input refused
    before any statement never reaches it, so nothing can be half-written."""
    def refuse() -> object:
        connections.append("asked")
        raise ConnectionRefusedError("the unit tier has no database")

    return create_engine("postgresql+psycopg://", creator=refuse)
