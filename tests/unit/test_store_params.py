"""Integer arrays go to PostgreSQL as array literals (store.int_array), and ids in flight as
multirange literals (store.id_ranges): exact, and only integers, so a literal cannot carry
anything else into the statement."""

from __future__ import annotations

import pytest

from outbox.store import IdRanges, id_ranges, int_array


def test_int_array_is_a_postgresql_array_literal() -> None:
    assert int_array([]) == "{}"
    assert int_array([1, -2, 2**62]) == "{1,-2,4611686018427387904}"
    assert int_array(n for n in (3, 4)) == "{3,4}"


def test_int_array_refuses_what_is_not_an_integer() -> None:
    for value in ("1},{2", None, 2.5, "3"):
        with pytest.raises(TypeError):
            int_array([1, value])  # type: ignore[list-item]


def test_id_ranges_is_a_multirange_literal_of_exactly_the_ids() -> None:
    assert id_ranges([]) == "{}"
    assert id_ranges([7]) == "{[7,7]}"
    assert id_ranges([1, 2, 3, 5, 6, 9]) == "{[1,3],[5,6],[9,9]}"
    # batches in flight one after another: each run as it comes (PostgreSQL sorts them)
    assert id_ranges(n for n in (10, 11, 3, 4, 12)) == "{[10,11],[3,4],[12,12]}"


def test_id_ranges_refuses_what_is_not_an_integer() -> None:
    for value in ("2],[9", None, 2.5, "3"):
        with pytest.raises(TypeError):
            id_ranges([1, value])  # type: ignore[list-item]


def test_id_ranges_rendered_once_join_into_one_literal_of_all_the_ids() -> None:
    first, second = IdRanges.of([5, 6, 7]), IdRanges.of([1, 9])
    assert (first.size, first.literal) == (3, "{[5,7]}")
    joined = IdRanges.joined([first, IdRanges.of([]), second])
    assert (joined.size, joined.literal) == (5, "{[5,7],[1,1],[9,9]}")
    assert IdRanges.joined([]) == IdRanges() and IdRanges().literal == "{}"
