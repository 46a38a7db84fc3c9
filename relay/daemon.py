"""The lifecycle the relay and the sweeper share: stop flags, signals, backoff on outages.

A daemon's pass fails when PostgreSQL (or Kafka) cannot be reached; :meth:`Lifecycle.serve`
runs the pass again with exponential backoff until told to stop, and says once that work
stalled (with the reason) and once that it resumed — never a line per retry.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Protocol

from prometheus_client import Gauge, start_http_server
from sqlalchemy import Engine
from tenacity import RetryCallState, Retrying, retry_if_exception

from outbox.exceptions import ConfigurationError, describe, server_trouble, setup_error, sqlstate

#: SQLSTATE of a statement cancelled: by a timeout, or by ``pg_cancel_backend``.
QUERY_CANCELED = "57014"
#: While an outage lasts, it is said again this often (with its latest reason).
REMIND_SECONDS = 300.0


class Abandoned(Exception):
    """Told to stop without waiting for the work in hand (a batch in flight, a tail read)."""


class Daemon(Protocol):
    lifecycle: Lifecycle

    def run(self) -> None: ...

    def stop(self, *, abandon: bool = False) -> None: ...


class Lifecycle:
    """Stop and abandon flags, and the outage state, of one daemon (safe from any thread)."""

    def __init__(self, name: str, log: logging.Logger, *,
                 paused: str = "paused: {reason}; retrying with backoff",
                 resumed: str = "working again after {seconds:.1f}s",
                 gauge: Gauge | None = None) -> None:
        self.name = name
        self.log = log
        self._paused = paused
        self._resumed = resumed
        #: 1 while work stalls (an outage), for a probe or an alert
        self._gauge = gauge
        self._kinds_said: set[str] = set()  #: the types of the reasons said, this outage
        self._said_at = 0.0  #: monotonic time the outage was last said
        #: Finish the work in hand, then stop.
        self.stopping = threading.Event()
        #: Stop at once; work in hand is left for the next owner.
        self.abandon = threading.Event()
        #: Its last line is said: a signal finds nothing left to finish or abandon.
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._outage_since: float | None = None
        self._reason = ""  #: the outage's cause last said
        self._failures = 0  #: failed passes since work last went on

    def stop(self, *, abandon: bool = False) -> None:
        self.stopping.set()
        if abandon:
            self.abandon.set()

    def say_stopped(self, message: str, *args: object) -> None:
        """Log the daemon's last line (INFO); a signal after it is ignored."""
        self.stopped.set()
        self.log.info(message, *args)

    def pause(self, seconds: float) -> None:
        """Sleep, but wake at once when told to stop."""
        self.stopping.wait(seconds)

    def serve(self, one_pass: Callable[[], None], retry_on: tuple[type[BaseException], ...],
              *, max_wait: float, engines: Sequence[Engine] = ()) -> None:
        """Run ``one_pass`` until it returns; after a ``retry_on`` failure, back off and rerun
        it, unless stopping (then the failure is swallowed if we were asked to stop). A setup
        mistake (a missing privilege or table) is raised at once: no retry can fix it.

        ``engines`` start each retry with new sessions: a pooled one keeps what its server
        was when it was made (a failover's standby, still read-only, or a setting since
        changed)."""
        retrying = Retrying(
            retry=retry_if_exception(
                lambda exc: isinstance(exc, retry_on) and setup_error(exc) is None),
            wait=lambda _state: self._backoff(max_wait),
            sleep=self.pause,
            stop=lambda _state: self.stopping.is_set(),
            before_sleep=lambda state: self._before_sleep(state, engines),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    one_pass()
        except retry_on as exc:
            if not self.stopping.is_set() or setup_error(exc) is not None:
                raise

    def _backoff(self, max_wait: float) -> float:
        """0.2 s, doubling up to ``max_wait``, counted from the last time work went on (a
        daemon's earlier outages do not lengthen the first wait of the next)."""
        with self._lock:
            self._failures += 1
            failures = self._failures
        return min(max_wait, 0.2 * 2.0 ** min(failures - 1, 32))

    def _before_sleep(self, state: RetryCallState, engines: Sequence[Engine]) -> None:
        for engine in engines:
            engine.dispose()
        self.outage(state.outcome.exception() if state.outcome else None)

    def outage(self, reason: BaseException | str | None, since: float | None = None) -> None:
        """Say once that work stalls, and why; again for a kind of reason not said yet in
        this outage (the database back, Kafka away now: not each time a pass alternates
        between two), and every ``REMIND_SECONDS`` while it lasts."""
        now = time.monotonic()
        kind = _kind(reason)
        text = reason if isinstance(reason, str) else describe(reason)
        with self._lock:
            began = self._outage_since
            if began is None:
                self._outage_since = since or now
                self._kinds_said = set()
            self._reason = text
            if began is not None and kind in self._kinds_said \
                    and now - self._said_at < REMIND_SECONDS:
                return
            self._kinds_said.add(kind)
            self._said_at = now
            if self._gauge is not None:  # under the lock: a recovery between cannot undo it
                self._gauge.set(1)
        if isinstance(reason, Exception) and statement_fault(reason):
            self.log.error("%s failed: %s; the statement itself failed, not the server: this "
                           "recurs until its cause is fixed (docs/operations.md, \"Errors "
                           "that recur\"); retrying with backoff", self.name, text,
                           exc_info=reason)
        elif began is None:
            self.log.warning("%s %s", self.name, self._paused.format(reason=text))
        else:
            self.log.warning("%s still paused after %.0fs: %s", self.name, now - began, text)

    def recovered(self) -> None:
        """Say once that work goes on again, after how long."""
        with self._lock:
            since, self._outage_since = self._outage_since, None
            self._failures = 0
            if since is not None and self._gauge is not None:
                self._gauge.set(0)
        if since is not None:
            self.log.warning("%s %s", self.name,
                             self._resumed.format(seconds=time.monotonic() - since))

    @property
    def in_outage(self) -> bool:
        with self._lock:
            return self._outage_since is not None

    @property
    def paused(self) -> tuple[float, str] | None:
        """While work stalls: for how many seconds, and its latest cause (None otherwise)."""
        with self._lock:
            since, reason = self._outage_since, self._reason
        return None if since is None else (time.monotonic() - since, reason)

    @property
    def outage_seconds(self) -> float:
        """How long the outage has lasted; 0 when there is none."""
        with self._lock:
            since = self._outage_since
        return 0.0 if since is None else time.monotonic() - since


def statement_fault(exc: Exception) -> bool:
    """A database error of the statement's own (a value it cannot store, a constraint, a
    trigger's exception, a limit of an index), not of a server that cannot work now: a
    retry meets it again, so it is said as an error, with its traceback. A statement
    cancelled (a timeout, an operator's ``pg_cancel_backend``) says nothing of a next one."""
    state = sqlstate(exc)
    return state is not None and state != QUERY_CANCELED and not server_trouble(exc)


def _kind(reason: BaseException | str | None) -> str:
    """An outage's kind of cause: its SQLSTATE if it has one, else its type; the driver's
    error's for SQLAlchemy's (every database error is an ``OperationalError`` there: a lost
    connection, then ``too many clients``, then a full disk are three causes)."""
    cause = getattr(reason, "orig", None) or reason
    return getattr(cause, "sqlstate", None) or type(cause).__name__


def run_until_signalled(daemon: Daemon) -> None:
    """Run ``daemon`` in this (main) thread, the process's own: the first SIGTERM, Ctrl-C or
    SIGHUP (its terminal or ssh session gone; there is nothing to reload) finishes the work in
    hand and stops; a second one abandons it.

    What is alive by now (modules, settings, engines) is frozen out of the cyclic garbage
    collector's reach: its full collections walked all of it, again and again, while a relay
    allocates thousands of objects a batch. That cost a relay a fifth of its throughput
    (BENCHMARKS.md); fewer collections (higher thresholds) won it back too, but lengthened
    the latency tail.
    """
    gc.freeze()
    lifecycle = daemon.lifecycle

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if lifecycle.stopped.is_set():  # it said "stopped": the process is on its way out
            return
        again = lifecycle.stopping.is_set()
        lifecycle.log.info(
            "%s: %s", signal.Signals(signum).name,
            "abandoning the work in hand (it stays pending)" if again
            else "finishing the work in hand, then stopping (signal again to abandon it)",
        )
        daemon.stop(abandon=again)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # HUP: a terminal gone
        signal.signal(signum, on_signal)
    daemon.run()


def serve_metrics(port: int, log: logging.Logger, address: str = "0.0.0.0") -> int:
    """Serve /metrics (the series of the modules this process imported: a sweeper's are its
    own), and say where (port 0 is one the system picks); a port in use or not ours to bind
    is a configuration error."""
    try:
        server, _thread = start_http_server(port, addr=address)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}; "
            "choose another --metrics-port") from None
    served: int = server.server_port
    log.info("serving metrics on http://%s:%d/metrics", address, served)
    return served
