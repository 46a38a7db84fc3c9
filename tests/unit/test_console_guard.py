"""Who may act through the console: the operator's name is checked before anything runs."""

from __future__ import annotations

import pytest

from outbox.console import guard
from outbox.settings import ConsoleSettings

TOKEN = "t" * 20


@pytest.mark.parametrize("name", ["élève", "", "a b", "x" * 65])
def test_an_operator_name_outside_the_rule_is_refused_with_the_rule(name: str) -> None:
    """The line said "letters", and "élève" was refused."""
    settings = ConsoleSettings(console_actions=True, console_token=TOKEN)
    form = {"csrf": "c", "token": TOKEN, "operator": name}
    with pytest.raises(guard.Refused) as refused:
        guard.operator_of(settings, form, "c", None, "127.0.0.1:8089")
    assert refused.value.status == 400
    assert refused.value.reason == ("refused: give your name as operator (ASCII letters, "
                                    "digits, _ . @ -; at most 64)")
    assert guard.operator_of(settings, {**form, "operator": "eleve@shop"}, "c", None,
                             "127.0.0.1:8089") == "eleve@shop"
