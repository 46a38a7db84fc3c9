"""The console's web application (Starlette, Jinja templates, served by uvicorn).

GET ``/`` is the page (``?topic=&key=`` filter the held messages); POST ``/resume`` resumes
messages when the console runs with actions on (``guard`` decides); GET ``/healthz``.
"""

from __future__ import annotations

import errno
import logging
import secrets
import signal
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from outbox import store
from outbox.console import chart, guard, scrape
from outbox.console.overview import (
    HELD_LIMIT,
    WINDOW_SECONDS,
    Deliveries,
    HeldFilter,
    Trend,
    read,
)
from outbox.encoding import ascii_digits
from outbox.exceptions import ConfigurationError, describe, server_trouble
from outbox.migrate import require_current
from outbox.settings import ConsoleSettings

#: What a port in use or one below 1024 says; any other bind error is the host's.
PORT_ERRORS = frozenset({errno.EADDRINUSE, errno.EACCES})

log = logging.getLogger("outbox.console")
#: Most messages one resume form may name.
MAX_SELECTION = 1000
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class Console:
    """The page's state: settings, one small engine, the templates and the backlog trend."""

    def __init__(self, settings: ConsoleSettings, overdue_seconds: float) -> None:
        self.settings, self.overdue_seconds = settings, overdue_seconds
        self.engine = store.engine(settings.sqlalchemy_url, pool_size=2, max_overflow=2,
                                    pool_pre_ping=True)
        self.templates = Environment(loader=PackageLoader("outbox.console"),
                                     autoescape=select_autoescape(default=True))
        self.trend = Trend(settings.console_refresh_seconds)
        self.deliveries = Deliveries()

    def render(self, request: Request, name: str, status: int = 200,
               **context: Any) -> HTMLResponse:
        nonce = secrets.token_urlsafe(16)
        csrf = request.cookies.get(guard.CSRF_COOKIE) or guard.new_csrf_token()
        html = self.templates.get_template(name).render(
            settings=self.settings, actions=self.settings.console_actions, nonce=nonce,
            csrf=csrf, **context)
        response = HTMLResponse(html, status_code=status, headers={
            **SECURITY_HEADERS,
            "Content-Security-Policy": (
                f"default-src 'none'; style-src 'unsafe-inline'; script-src 'nonce-{nonce}'; "
                "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; "
                "base-uri 'none'"),
        })
        if self.settings.console_actions:
            response.set_cookie(guard.CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        return response

    def database_away(self, request: Request, exc: Exception) -> Response:
        """PostgreSQL does not answer: the page says so (503), and the log in one line; it
        answered a bare 500 and logged three chained tracebacks a request. Any other
        database error is a bug, and keeps its traceback."""
        if not server_trouble(exc):
            raise exc
        reason = describe(exc)
        log.warning("cannot read schema %s: %s", self.settings.schema_name, reason)
        return self.render(request, "outcome.html", status=503, title="unavailable", refused=(
            f"PostgreSQL does not answer ({reason}); this page reads it again when reloaded"))

    def page(self, request: Request) -> Response:
        held = HeldFilter(topic=request.query_params.get("topic") or None,
                          key=request.query_params.get("key") or None)
        if held.topic is not None and "\x00" in held.topic:  # PostgreSQL's text refuses it
            return self.render(request, "outcome.html", status=400, title="console",
                               refused="refused: a topic has no NUL character")
        with self.engine.connect() as conn:
            view = read(conn, self.settings, held, self.overdue_seconds, self.deliveries)
        view.trend = self.trend.add(sum(view.totals.values()))
        return self.render(request, "console.html", view=view, held_filter=held, now=_now(),
                           held_limit=HELD_LIMIT,
                           endpoints=scrape.scrape_all(self.settings.console_metrics_urls),
                           charts=chart.charts(view.minutes, view.trend, WINDOW_SECONDS))

    async def resume(self, request: Request) -> Response:
        raw = await request.form()
        form = {key: str(raw[key]) for key in ("csrf", "token", "operator") if key in raw}
        try:
            operator = guard.operator_of(
                self.settings, form, request.cookies.get(guard.CSRF_COOKIE),
                request.headers.get("origin"), request.headers.get("host"))
            ids = _ids([str(v) for v in raw.getlist("one") or raw.getlist("ids")])
        except guard.Refused as refused:
            return self.render(request, "outcome.html", status=refused.status,
                               refused=refused.reason)
        with self.engine.connect() as conn, conn.begin():
            resumed = store.resume(conn, self.settings.schema_name, f"console:{operator}", ids)
        missing = sorted(set(ids) - {message_id for message_id, _ in resumed})
        if not resumed:  # as `outbox resume` exits 1: the page said "Resumed by ..."
            return self.render(request, "outcome.html", status=409, refused=(
                "not resumed (unknown, or neither PARKED nor DISCARDED): "
                + ", ".join(map(str, missing))))
        return self.render(request, "outcome.html", resumed=resumed, missing=missing,
                           operator=operator)


    def report(self, request: Request) -> Response:
        """A reconciliation run's report.txt, when its output folder is visible here."""
        asked = request.path_params["run_id"]
        runs = []
        if _an_id(asked):  # one past bigint was a 500, out of range in the database
            with self.engine.connect() as conn:
                runs = store.reconcile_runs(conn, self.settings.schema_name, 1, int(asked))
        if not runs:
            return self.render(request, "outcome.html", status=404, title="report",
                               refused=f"no reconciliation run {asked}")
        path = Path(runs[0]["output_path"], "report.txt")
        try:
            text: str | None = path.read_text(errors="replace")
        except OSError:
            text = None
        return self.render(request, "report.html", run=runs[0], path=path, report=text)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _an_id(value: str) -> bool:
    """Digits a bigint holds (up to 18)."""
    return ascii_digits(value) and 0 < len(value) < 19


def _ids(values: list[str]) -> list[int]:
    if not values:
        raise guard.Refused(400, "refused: select at least one message")
    if len(values) > MAX_SELECTION or not all(_an_id(v) for v in values):
        raise guard.Refused(400, f"refused: message ids are numbers (at most {MAX_SELECTION})")
    return sorted({int(v) for v in values})


def create_app(settings: ConsoleSettings, overdue_seconds: float) -> Starlette:
    """The console for ``settings``; refuses at once a schema that is not migrated."""
    console = Console(settings, overdue_seconds)
    with console.engine.connect() as conn:
        require_current(conn, settings.schema_name)
        role = store.console_overreach(conn, settings.schema_name)
    if role is not None:
        log.warning("the console runs as %s, which may delete the outbox's rows: run it as a "
                    "member of %s_console (`outbox db upgrade --create-roles`)", role,
                    settings.schema_name)
    routes = [
        Route("/", console.page, methods=["GET"]),
        Route("/resume", console.resume, methods=["POST"]),
        Route("/runs/{run_id}/report", console.report, methods=["GET"]),
        Route("/healthz", lambda _request: PlainTextResponse("ok"), methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=[
        Middleware(_TrustedHosts, allowed_hosts=allowed_hosts(settings))],
        exception_handlers={DBAPIError: console.database_away})


class _TrustedHosts(TrustedHostMiddleware):
    """Starlette's check of the Host header, but not of ``/healthz`` (it shows nothing, and
    a probe asks it by whatever address it has)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/healthz":
            await self.app(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


#: The names a browser on this machine reaches a loopback console by.
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "[::1]"]


def allowed_hosts(settings: ConsoleSettings) -> list[str]:
    """The Host headers the console answers: a page on a name of an attacker's that resolves
    to 127.0.0.1 (DNS rebinding) would otherwise read it from the operator's own browser."""
    if settings.console_allowed_hosts:
        return settings.console_allowed_hosts
    if settings.console_host in ("localhost", "::1") or settings.console_host.startswith("127."):
        return [*LOOPBACK_NAMES, settings.console_host]
    return ["*"]


def serve(settings: ConsoleSettings, overdue_seconds: float) -> None:
    """Serve the console until SIGTERM or Ctrl-C."""
    import uvicorn

    listening = _listen(settings.console_host, settings.console_port)
    config = uvicorn.Config(create_app(settings, overdue_seconds), host=settings.console_host,
                            port=settings.console_port, log_level=settings.log_level.lower(),
                            server_header=False)
    server = uvicorn.Server(config)

    def stop(_signum: int, _frame: object) -> None:
        server.should_exit = True

    # Until now a signal stopped the command where it was (outbox/cli.py, a console that
    # waits for PostgreSQL's first answer); these handlers set those aside only once the
    # console is made (set before, they made it wait on and serve). uvicorn takes SIGINT and
    # SIGTERM over as it runs and raises them again here once it has shut down: a stop asked
    # for is then a clean exit (status 0), as for the relay. SIGHUP (a terminal or ssh
    # session gone), which uvicorn leaves alone, killed the console without a word.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    host, port = listening.getsockname()[:2]
    log.info("serving the console on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    server.run(sockets=[listening])


def _listen(host: str, port: int) -> socket.socket:
    """The console's socket, bound before uvicorn starts: a port in use or not ours is one
    configuration error's line (uvicorn logged six lines and exited 3)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        raise ConfigurationError(f"cannot serve the console on {host}:{port}: "
                                 f"{exc.strerror or exc}; choose another "
                                 f"{'--port' if exc.errno in PORT_ERRORS else '--host'}"
                                 ) from None
    return listening
