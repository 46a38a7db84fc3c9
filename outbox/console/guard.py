"""The rules a console action must pass, in order: actions enabled at start, a form from
this console's own page (CSRF: the cookie's value echoed in the form, same origin), the
operator's token (constant-time compare) and an operator name safe to record."""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Mapping
from urllib.parse import urlsplit

from outbox.settings import ConsoleSettings

CSRF_COOKIE = "outbox_console_csrf"
OPERATOR = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class Refused(Exception):
    """An action the console will not do, with the HTTP status and a line saying why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def _same(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def operator_of(settings: ConsoleSettings, form: Mapping[str, str], cookie: str | None,
                origin: str | None, host: str | None) -> str:
    """The operator on whose behalf the action runs, or :class:`Refused`."""
    if not settings.console_actions:
        raise Refused(403, "this console is read-only: actions are off (start it with "
                      "--allow-actions and OUTBOX_CONSOLE_TOKEN)")
    if origin is not None and urlsplit(origin).netloc != host:
        raise Refused(403, "refused: the form was sent from another site (CSRF check)")
    if not cookie or not _same(form.get("csrf", ""), cookie):
        raise Refused(403, "refused: the form is stale or came from another site (CSRF "
                      "check); reload the page and try again")
    expected = settings.console_token.get_secret_value()
    if not expected or not _same(form.get("token", ""), expected):
        raise Refused(403, "refused: wrong or missing token")
    operator = form.get("operator", "").strip()
    if not OPERATOR.fullmatch(operator):
        raise Refused(400, "refused: give your name as operator (ASCII letters, digits, "
                      "_ . @ -; at most 64)")  # it said "letters", and refused "élève"
    return operator
