"""What a local transaction or checker may answer, and what the outbox makes of it."""

from __future__ import annotations

import pytest

from outbox import store
from outbox.checkers import to_resolution
from outbox.schema import Resolution


@pytest.mark.parametrize(
    ("answer", "resolution"),
    [
        ("COMMIT", Resolution.COMMIT),
        (" rollback\n", Resolution.ROLLBACK),
        ("Unknown", Resolution.UNKNOWN),
        (Resolution.COMMIT, Resolution.COMMIT),
        (None, Resolution.UNKNOWN),
    ],
)
def test_answers_are_read_case_and_space_insensitively(answer: object,
                                                       resolution: Resolution) -> None:
    assert to_resolution(answer, "checker") is resolution


@pytest.mark.parametrize("answer", [True, 1, "COMMITTED", "", b"COMMIT"])
def test_any_other_answer_is_a_bug_in_the_checker(answer: object) -> None:
    with pytest.raises(TypeError, match=r"checker 'orders' answered .*; answer COMMIT, ROLLBACK"):
        to_resolution(answer, "checker 'orders'")


def test_a_wrong_answer_is_told_by_its_type_and_length_never_its_content() -> None:
    """The answer was shown in full, in the log line and the op record: a SQL checker
    answering ``SELECT :payload`` wrote the payload (a card number) into both."""
    with pytest.raises(TypeError) as raised:
        to_resolution('{"order_id":1,"card":"4111-1111-1111-1111"}', "checker 'leak'")
    assert str(raised.value) == ("checker 'leak' answered a value of type str (length 43); "
                                 "answer COMMIT, ROLLBACK or UNKNOWN (or None)")


def test_a_detail_is_cut_to_its_bound_and_says_how_long_it_was() -> None:
    assert store.as_detail("short") == "short"
    cut = store.as_detail("x" * 10_000_000)
    assert len(cut) == store.DETAIL_CHARS and cut.endswith("x... (10000000 characters)")
    assert store.as_detail(cut) == cut
