"""Integer arrays go to PostgreSQL as array literals (store.int_array): exact, and only
integers, so a literal cannot carry anything else into the statement."""

from __future__ import annotations

import pytest

from outbox.store import int_array


def test_int_array_is_a_postgresql_array_literal() -> None:
    assert int_array([]) == "{}"
    assert int_array([1, -2, 2**62]) == "{1,-2,4611686018427387904}"
    assert int_array(n for n in (3, 4)) == "{3,4}"


def test_int_array_refuses_what_is_not_an_integer() -> None:
    with pytest.raises(ValueError):
        int_array(["1},{2"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        int_array([None])  # type: ignore[list-item]
