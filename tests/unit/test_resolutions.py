"""What a local transaction or checker may answer, and what the outbox makes of it."""

from __future__ import annotations

import pytest

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
