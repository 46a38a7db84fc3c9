"""The unit tier runs without PostgreSQL or a broker, and without the caller's OUTBOX_* shell."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NoReturn

import pytest


@pytest.fixture(scope="session")
def services() -> NoReturn:
    """Guard: a unit test that needs the real services belongs in tests/integration."""
    pytest.fail("unit tests start no PostgreSQL or broker: move this test to tests/integration")


@pytest.fixture(autouse=True)
def clean_environment() -> Iterator[None]:
    """No OUTBOX_* variable leaks in from the shell, and whatever a test sets is undone."""
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.startswith("OUTBOX_")]:
        del os.environ[name]
    yield
    os.environ.clear()
    os.environ.update(saved)
