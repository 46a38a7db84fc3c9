"""The check-back sweeper: asks checkers about UNKNOWN messages, at most ``check_max`` times.

RocketMQ's transactional check on PostgreSQL. A row whose resolution is UNKNOWN is due
``transaction_timeout`` (or its own check immunity) after it was written, then every
``check_interval``. The sweeper claims due rows with FOR UPDATE SKIP LOCKED, pushing their
``next_check_at`` past the checker timeout: several sweepers never check one row at the same
time, and a crashed sweeper's claims simply expire. Each check runs its producer group's
checker in a worker thread (at most ``sweep_concurrency`` at once, so one slow checker does
not starve the others; a group whose Python checks are stuck past their timeout is set aside
until one ends), in a read-only transaction with a statement timeout. COMMIT hands
the row to the relay, ROLLBACK closes it; an UNKNOWN answer, an error or a timeout is
counted, and the ``check_max``-th such check discards the row: kept, logged, counted,
listed by ``outbox discarded`` and re-armed by ``outbox resume``.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import psycopg
from prometheus_client import Counter, Gauge
from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry

from outbox import store
from outbox.app import Outbox
from outbox.checkers import Checker, SqlChecker, synchronous, to_resolution
from outbox.exceptions import (
    READ_ONLY_TRANSACTION,
    CheckerRefused,
    ConfigurationError,
    first_line,
    server_trouble,
    sqlstate,
)
from outbox.migrate import require_current, require_writable
from outbox.pooling import refuse_transaction_pooling
from outbox.relay.daemon import Lifecycle
from outbox.schema import Resolution, Status
from outbox.settings import SweepSettings, mask_url

log = logging.getLogger("outbox.sweeper")

CHECKS = Counter(
    "outbox_check_backs", "Check-backs recorded, by producer group and outcome "
    "(COMMIT, ROLLBACK, UNKNOWN, ERROR, TIMEOUT)", ["producer_group", "outcome"],
)
DISCARDED = Counter(
    "outbox_messages_discarded", "Messages discarded after check_max inconclusive check-backs",
    ["producer_group"],
)
STUCK = Gauge(
    "outbox_checks_stuck",
    "Checks still running past the checker timeout (a Python checker cannot be stopped)",
    ["producer_group"],
)
PAUSED = Gauge("outbox_sweeper_paused", "1 while the sweeper cannot reach PostgreSQL")
UNCHECKED = Gauge(
    "outbox_unchecked_messages",
    "Due UNKNOWN messages of producer groups this sweeper has no checker for",
    ["producer_group"],
)

#: A claim outlives the checker timeout by this much, so a timeout is recorded before
#: another sweeper may claim the row.
CLAIM_MARGIN = 2.0
#: The first sleep when rows are due but locked (another sweeper taking its claim, or an
#: application deciding in a long transaction); it doubles while they stay locked, up to
#: the poll interval (at 20 a second it was one claim a second, per sweeper, ten times over).
MIN_SLEEP = 0.05


#: ``module[.submodule][:attribute]``, what :func:`load_app` takes.
APP_PATH = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*(:[^\W\d]\w*)?")


def load_app(path: str) -> Outbox:
    """The ``Outbox`` at ``module:attribute`` (attribute ``outbox`` if omitted)."""
    module_name, _, attribute = path.partition(":")
    if not APP_PATH.fullmatch(path):  # import_module raised ValueError or TypeError
        raise ConfigurationError(
            f"--app {path}: give module:attribute, e.g. myservice.outbox:outbox (a module "
            "importable from the working directory, no leading dot)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the service's own modules import
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"--app {path}: cannot import {module_name!r} ({exc})") from None
    name = attribute or "outbox"
    app = getattr(module, name, None)
    if not isinstance(app, Outbox):
        what = (f"{module_name} has no attribute {name!r}" if not hasattr(module, name)
                else f"{module_name}.{name} is a {type(app).__name__}, not an outbox.Outbox")
        raise ConfigurationError(
            f"--app {path}: {what} (give module:attribute of the Outbox your checkers are "
            "registered on)")
    return app


def checkers_for(settings: SweepSettings, checkers: Mapping[str, Checker]) -> dict[str, Checker]:
    """Python checkers and the SQL checkers of ``OUTBOX_SQL_CHECKERS``, by producer group."""
    found: dict[str, Checker] = {}
    for group, sql in settings.sql_checkers.items():
        try:
            found[group] = SqlChecker(sql, settings.schema_name)
        except ValueError as exc:
            raise ConfigurationError(
                f"the SQL checker of producer group {group!r} {exc} (OUTBOX_SQL_CHECKERS)"
            ) from None
    for group, checker in checkers.items():
        if group in found:
            raise ConfigurationError(
                f"producer group {group!r} has a Python checker and a SQL checker "
                "(OUTBOX_SQL_CHECKERS): keep one"
            )
        found[group] = synchronous(checker, group)
    if not found:
        raise ConfigurationError(
            "the sweeper has no checkers: pass --app module:outbox (an Outbox with "
            "@outbox.checker functions) or set OUTBOX_SQL_CHECKERS"
        )
    return found


@dataclass
class _Running:
    claim: store.Claim
    deadline: float
    #: counted as timed out at its deadline (_expire): its answer, if one comes, is late
    expired: bool = False
    #: its checker returned or raised: it is not counted as timed out (set under the lock,
    #: as ``expired`` is, so that one check is never counted both ways)
    ended: bool = False
    #: The connection the check runs on while it runs: cancelled at the deadline.
    driver: psycopg.Connection[Any] | None = None


@dataclass
class SweepCounts:
    """What this sweeper has recorded, and what it cannot check (its status)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    discarded: int = 0
    #: Due messages per producer group without a checker here; they wait, uncounted.
    unchecked: dict[str, int] = field(default_factory=dict)


class Sweeper:
    """Run with :meth:`run`; :meth:`stop` (or SIGTERM via the CLI) ends it."""

    def __init__(self, settings: SweepSettings, checkers: Mapping[str, Checker] | None = None
                 ) -> None:
        settings.require("database_url")
        self.settings = settings
        self.schema = settings.schema_name
        self.checkers = checkers_for(settings, checkers or {})
        self.groups = sorted(self.checkers)
        self.actor = f"sweeper:{settings.worker_id}"
        self.counts = SweepCounts()
        #: After :meth:`run`: the messages whose checks still ran past their timeout (their
        #: threads would keep the interpreter from exiting: ``outbox sweep`` exits without
        #: them)
        self.stuck: list[int] = []
        self.lifecycle = Lifecycle(
            f"sweeper {settings.worker_id}", log,
            paused="cannot reach PostgreSQL ({reason}); retrying with backoff",
            resumed="reaches PostgreSQL again after {seconds:.1f}s", gauge=PAUSED)
        self._stopped: Future[None] = Future()  # completed by stop(): wakes the loop's wait
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        #: A group with this many checks stuck past their timeout is not claimed until one
        #: ends: each keeps its thread and connection, and its messages would be claimed
        #: and stuck again while the other groups' waited for a free slot.
        self._stuck_limit = max(1, settings.sweep_concurrency // 2)
        self._stuck_groups: set[str] = set()
        #: threads (and connections) the checks may hold: the running ones, and per group
        #: the stuck ones, below the limit and then as many as were running when they
        #: timed out (a check waiting for a thread would be counted as timed out unrun)
        self._threads = settings.sweep_concurrency + len(self.groups) * (
            self._stuck_limit - 1 + settings.sweep_concurrency)
        self._engine: Engine = store.engine(
            settings.sqlalchemy_url, pool_size=settings.sweep_concurrency + 1,
            max_overflow=self._threads - settings.sweep_concurrency + 2,
            pool_pre_ping=True,
            connect_args={"application_name": f"outbox-sweeper:{settings.worker_id}"[:63]},
        )
        event.listen(self._engine, "checkin", _end_unreset)

    @property
    def stopping(self) -> threading.Event:
        return self.lifecycle.stopping

    def stop(self, *, abandon: bool = False) -> None:
        """Stop claiming; running checks may land their answers (unless ``abandon``)."""
        self.lifecycle.stop(abandon=abandon)
        if not self._stopped.done():
            self._stopped.set_result(None)

    def run(self) -> None:
        refuse_transaction_pooling(self.settings.sqlalchemy_url,
                                   f"sweeper {self.settings.worker_id}")
        with self._engine.connect() as conn:
            require_current(conn, self.schema)
            require_writable(conn, self.schema, mask_url(self.settings.database_url))
            conn.rollback()
            self._refuse_bad_sql_checkers(conn)
        log.info("sweeper %s started: database %s, schema %s, checkers for %s",
                 self.settings.worker_id, mask_url(self.settings.database_url), self.schema,
                 ", ".join(self.groups))
        executor = ThreadPoolExecutor(self._threads, "checker")
        running: dict[Future[None], _Running] = {}
        try:
            self.lifecycle.serve(lambda: self._serve(executor, running), (DBAPIError,),
                                 max_wait=10, engines=(self._engine,))
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            self._let_answers_land(running)
            self._say_unfinished(running)
            self._engine.dispose()
            self.lifecycle.say_stopped("sweeper %s stopped after %d check-backs",
                                       self.settings.worker_id, sum(self.counts.outcomes.values()))

    def _let_answers_land(self, running: dict[Future[None], _Running]) -> None:
        """Wait, up to their deadlines, for running checks to record their answers, then
        count those still running as timed out; a second signal (``abandon``) ends the wait
        and counts none. Checks already counted as timed out are not waited for."""
        waiting = {future: item for future, item in running.items() if not item.expired}
        deadline = max((item.deadline for item in waiting.values()), default=0.0)
        while not self.lifecycle.abandon.is_set() and time.monotonic() < deadline:
            if not wait(waiting, timeout=min(0.1, deadline - time.monotonic())).not_done:
                return
        if waiting and not self.lifecycle.abandon.is_set():
            with contextlib.suppress(DBAPIError), self._engine.connect() as conn:
                self._expire(conn, waiting, time.monotonic())  # (it logs what it could not)

    def _say_unfinished(self, running: dict[Future[None], _Running]) -> None:
        """Name the checks still running at the end (``stuck``): their threads are left to
        run, and ``outbox sweep`` exits without them."""
        left = [item for future, item in running.items() if not future.done()]
        self.stuck = sorted({item.claim.message.id for item in left})
        if not left:
            return
        why = ("a Python checker cannot be stopped" if any(
            not isinstance(self.checkers[item.claim.message.producer_group], SqlChecker)
            for item in left) else "a SQL checker's statement ends at its checker_timeout")
        for expired, said in ((True, "are still running past their timeout ({why}); their "
                                     "timeouts are counted"),
                              (False, "were abandoned ({why}); their messages are checked "
                                      "again when their claims expire")):
            ids = sorted({item.claim.message.id for item in left if item.expired == expired})
            if ids:
                log.warning("sweeper %s: checks of messages %s %s", self.settings.worker_id,
                            ", ".join(map(str, ids)), said.format(why=why))

    def _serve(self, executor: ThreadPoolExecutor, running: dict[Future[None], _Running]
               ) -> None:
        with self._engine.connect() as conn:
            self._loop(conn, executor, running)

    def _loop(self, conn: Connection, executor: ThreadPoolExecutor,
              running: dict[Future[None], _Running]) -> None:
        settings = self.settings
        report_at = 0.0
        locked = 0.0  # how long the sweeper last slept on due rows it could not claim
        while not self.stopping.is_set():
            now = time.monotonic()
            self._expire(conn, running, now)
            if now >= report_at:
                self._report_unchecked(conn)
                report_at = now + settings.check_interval
            live = sum(1 for item in running.values() if not item.expired)
            groups = self._claimable(running)
            wanted = min(settings.sweep_concurrency - live, settings.sweep_batch_size)
            claims: list[store.Claim] = []
            if wanted > 0 and groups:
                with conn.begin():
                    claims = store.claim_checks(conn, self.schema, groups, wanted,
                                                settings.checker_timeout + CLAIM_MARGIN)
            self.lifecycle.recovered()  # its statements ran: not merely connected
            started = time.monotonic()
            for claim in claims:
                item = _Running(claim, started + settings.checker_timeout)
                running[executor.submit(self._check, item)] = item
            timeout = settings.sweep_poll_interval
            if claims and len(claims) == wanted and live + len(claims) < settings.sweep_concurrency:
                timeout = 0.0  # a full batch, and room for more: claim again at once
            deadlines = [r.deadline for r in running.values() if not r.expired]
            if deadlines:
                timeout = min(timeout, min(deadlines) - time.monotonic())
            due_in = None
            if len(claims) < wanted and groups:  # nothing more is due: sleep until the next is
                with conn.begin():
                    due_in = store.next_check_in(conn, self.schema, groups)
            if due_in is not None and due_in <= 0:  # due, yet not claimed: locked
                locked = min(2 * locked or MIN_SLEEP, settings.sweep_poll_interval)
                timeout = min(timeout, locked)
            else:
                locked = 0.0
                if due_in is not None:
                    timeout = min(timeout, due_in)
            done, _ = wait([*running, self._stopped], max(timeout, 0.0),
                           return_when=FIRST_COMPLETED)
            for future in done:
                ended = running.pop(future, None)
                if ended is not None and future.exception() is not None:
                    log.warning("message %d (producer group %r): check-back failed, retried "
                                "when its claim expires: %s", ended.claim.message.id,
                                ended.claim.message.producer_group,
                                first_line(future.exception()))

    def _claimable(self, running: dict[Future[None], _Running]) -> list[str]:
        """The groups whose messages may be claimed: not those with ``_stuck_limit`` checks
        still running past their timeout (said once, and by ``outbox_checks_stuck``)."""
        stuck = collections.Counter(item.claim.message.producer_group
                                    for item in running.values() if item.expired)
        for group in self.groups:
            STUCK.labels(group).set(stuck[group])
        blocked = {group for group, count in stuck.items() if count >= self._stuck_limit}
        for group in sorted(blocked - self._stuck_groups):
            log.warning("producer group %r: %d checks still run past their timeout of %g s "
                        "(a Python checker cannot be stopped: give its calls a timeout); its "
                        "messages are not checked until one ends, the other groups' are",
                        group, stuck[group], self.settings.checker_timeout)
        for group in sorted(self._stuck_groups - blocked):
            log.warning("producer group %r: a stuck check ended; checking its messages again",
                        group)
        self._stuck_groups = blocked
        return [group for group in self.groups if group not in blocked]

    def _refuse_bad_sql_checkers(self, conn: Connection) -> None:
        """Prepare each SQL checker once at start, as a check would: one that PostgreSQL
        refuses stops the sweeper with one line, not its producer group 15 checks later."""
        sql_checkers = {group: checker for group, checker in self.checkers.items()
                        if isinstance(checker, SqlChecker)}
        if not sql_checkers:
            return
        with conn.begin():
            ready = store.sql_checker_ready(conn, self.schema)
        if not ready:
            raise ConfigurationError(
                f"SQL checkers run as the role {self.schema}_checker, which is missing: run "
                "`outbox db upgrade --create-roles` (docs/operations.md)")
        for group, checker in sql_checkers.items():
            try:
                with conn.begin() as transaction:
                    store.begin_check(conn, self.schema, self.settings.checker_timeout,
                                      self.settings.checker_timeout + CLAIM_MARGIN)
                    store.prepare_sql_checker(conn, self.schema, checker.statement)
                    refusal = store.sql_checker_refusal(conn, self.schema)
                    if refusal is not None:
                        raise CheckerRefused(refusal)
                    transaction.rollback()
                store.reset_session(conn, self.schema)
            except (CheckerRefused, DBAPIError) as exc:
                if isinstance(exc, DBAPIError) and server_trouble(exc):
                    raise  # the server's, not the checker's: reported as any other
                if store.cut_off(exc):
                    log.warning("could not prepare the SQL checker of producer group %r within "
                                "the checker timeout (%g s: a table it reads is locked?); its "
                                "checks will tell", group, self.settings.checker_timeout)
                    continue
                raise ConfigurationError(
                    f"the SQL checker of producer group {group!r} is refused: "
                    f"{first_line(exc)} (OUTBOX_SQL_CHECKERS)") from None

    def _check(self, item: _Running) -> None:
        """One check-back, in a worker thread; then records its outcome."""
        message = item.claim.message
        try:
            resolution, kind, detail = self._ask(item)
            detail = store.as_detail(detail)  # logged and recorded: bounded
        finally:
            with self._lock:
                item.ended = True
                expired = item.expired
        if expired:  # counted and logged at its deadline (_expire), which cancelled it
            if resolution != Resolution.UNKNOWN:
                self._record_late(item, resolution)
            return
        if kind in ("ERROR", "TIMEOUT"):
            log.warning("message %d (producer group %r): %s; counted as inconclusive",
                        message.id, message.producer_group, detail)
        outcome = store.CheckOutcome(message.id, item.claim.token, resolution, detail)
        with self._engine.connect() as conn:
            _say(self._record(conn, [(outcome, kind)]))

    def _record_late(self, item: _Running, resolution: Resolution) -> None:
        """A COMMIT or ROLLBACK that came after the check's timeout was counted: it decides
        the message if still undecided (a checker a little too slow had every answer dropped,
        and its messages discarded), and says so with the setting that would have let it
        in time. Not after the sweeper has stopped."""
        message, timeout = item.claim.message, self.settings.checker_timeout
        late = f"its checker answered {resolution} {time.monotonic() - item.deadline:.1f} s "\
            f"after its timeout of {timeout:g} s"
        said = "message %d (producer group %r): %s; "
        if self.lifecycle.stopped.is_set():
            log.warning(said + "not recorded: the sweeper has stopped (it is checked again)",
                        message.id, message.producer_group, late)
            return
        outcome = store.CheckOutcome(message.id, item.claim.token, resolution,
                                     f"checker answered {resolution} after its timeout of "
                                     f"{timeout:g} s")
        try:
            with self._engine.connect() as conn:
                recorded = self._record(conn, [(outcome, resolution.value)], late=True)
        except DBAPIError as exc:
            log.warning(said + "not recorded (PostgreSQL: %s)", message.id,
                        message.producer_group, late, first_line(exc))
            return
        if recorded:
            log.warning(said + "recorded (give it a longer OUTBOX_CHECKER_TIMEOUT)",
                        message.id, message.producer_group, late)
        else:
            log.warning(said + "ignored: the message was decided or discarded meanwhile "
                        "(`outbox resume %d` checks a discarded one again)", message.id,
                        message.producer_group, late, message.id)
        _say(recorded)

    def _ask(self, item: _Running) -> tuple[Resolution, str, str]:
        """The checker's answer, outcome kind and detail. Its connection is reset afterwards
        (DISCARD ALL), or closed if the check failed: a check leaves nothing on the pool."""
        message = item.claim.message
        group = message.producer_group
        if item.claim.unreadable:
            return Resolution.UNKNOWN, "ERROR", f"not checked: {item.claim.unreadable}"
        with self._engine.connect() as conn:
            driver = conn.connection.driver_connection
            conn.info[_LENT] = True  # until reset: closed by the checker, it is discarded
            try:
                with self._cancellable(item, conn):
                    conn.begin()
                    store.begin_check(conn, self.schema, self.settings.checker_timeout,
                                      self.settings.checker_timeout + CLAIM_MARGIN)
                    answer = self.checkers[group](message, conn)
            except BaseException as exc:  # sys.exit, a cancelled coroutine's: errors too
                # the check's session lost to the server, not closed by the checker itself
                lost = (driver is None or driver.closed or driver.broken) and not _reused(exc)
                _discard(conn)
                return self._failed(item, exc, lost)
            _reset(conn, self.schema)
        try:
            resolution = to_resolution(answer, f"the checker of producer group {group!r}")
        except TypeError as exc:
            return (Resolution.UNKNOWN, "ERROR",
                    f"checker raised TypeError: {store.as_text(first_line(exc))}")
        return resolution, resolution.value, f"checker answered {resolution}"

    def _failed(self, item: _Running, exc: BaseException, lost: bool
                ) -> tuple[Resolution, str, str]:
        """A check that raised ``exc``, counted as inconclusive; raised again if it says
        nothing of the message (its session ``lost`` to the server, or cancelled early)."""
        if store.cut_off(exc):
            if item.expired or time.monotonic() >= item.deadline:
                return Resolution.UNKNOWN, "TIMEOUT", _timed_out(self.settings.checker_timeout)
            raise exc  # cancelled before its time (pg_cancel_backend): checked again
        # a write the check's read-only transaction refused is the checker's own doing
        wrote = not lost and sqlstate(exc) == READ_ONLY_TRANSACTION
        if isinstance(exc, DBAPIError) and server_trouble(exc) and not wrote:
            if lost:  # not the message's fault: uncounted, checked again (_loop logs)
                raise exc
            # else a database of the checker's own does not answer: the check failed
        elif isinstance(exc, CheckerRefused | DBAPIError):
            return Resolution.UNKNOWN, "ERROR", f"PostgreSQL refused: {first_line(exc)}"
        return (Resolution.UNKNOWN, "ERROR",  # its text as it is recorded, logged too
                f"checker raised {type(exc).__name__}: {store.as_text(first_line(exc))}")

    @contextlib.contextmanager
    def _cancellable(self, item: _Running, conn: Connection) -> Iterator[None]:
        """While the check runs, ``_expire`` may cancel its statement at the deadline: a
        client-side backstop to the statement timeout of ``begin_check``."""
        with self._lock:
            item.driver = conn.connection.driver_connection
        try:
            yield
        finally:
            with self._lock:
                item.driver = None

    def _expire(self, conn: Connection, running: dict[Future[None], _Running], now: float
                ) -> None:
        """Count checks past the checker timeout as inconclusive, before their claim lapses.

        The thread may still finish: a late COMMIT or ROLLBACK then decides the message if it
        is still undecided (:meth:`_record_late`).
        """
        with self._lock:  # one that ended unrecorded (in a database outage) is not counted:
            overdue = [r for r in running.values()  # its claim lapses, and it is checked again
                       if not (r.expired or r.ended) and r.deadline <= now]
            for item in overdue:
                item.expired = True
        if not overdue:
            return
        detail = _timed_out(self.settings.checker_timeout)
        for item in overdue:
            with self._lock:
                if item.driver is not None:
                    try:
                        item.driver.cancel_safe(timeout=1.0)
                    except psycopg.Error as exc:  # the server answers no new connection
                        log.warning("message %d (producer group %r): could not cancel its "
                                    "check's statement (%s); its statement timeout ends it",
                                    item.claim.message.id, item.claim.message.producer_group,
                                    first_line(exc))
        recorded: list[Any] = []
        try:
            recorded = self._record(conn, [
                (store.CheckOutcome(r.claim.message.id, r.claim.token, Resolution.UNKNOWN,
                                    detail), "TIMEOUT")
                for r in overdue
            ])
        finally:  # said once it is known: an outage here leaves them uncounted
            counted = {row.id for row in recorded}
            for item in overdue:
                log.warning("message %d (producer group %r): %s; %s",
                            item.claim.message.id, item.claim.message.producer_group, detail,
                            "counted as inconclusive" if item.claim.message.id in counted
                            else "not counted (PostgreSQL did not take it): checked again "
                            "when its claim expires")
        _say(recorded)  # after the timeouts that led to them

    def _record(self, conn: Connection, outcomes: list[tuple[store.CheckOutcome, str]],
                *, late: bool = False) -> list[Any]:
        """Record check outcomes, counted (``late`` answers, whose timeouts were, are not);
        the rows recorded (a claim that lapsed is not), for :func:`_say`."""
        with conn.begin():
            recorded = store.record_checks(
                conn, self.schema, self.actor, [outcome for outcome, _ in outcomes],
                check_interval=self.settings.check_interval, check_max=self.settings.check_max,
                late=late,
            )
        kinds = {outcome.id: kind for outcome, kind in outcomes}
        for row in recorded if not late else ():
            CHECKS.labels(row.producer_group, kinds[row.id]).inc()
            with self._lock:
                self.counts.outcomes[kinds[row.id]] += 1
            if row.status == Status.DISCARDED:
                DISCARDED.labels(row.producer_group).inc()
                with self._lock:
                    self.counts.discarded += 1
        return list(recorded)

    def _report_unchecked(self, conn: Connection) -> None:
        """Report due messages no checker here can answer: logged once per group, counted."""
        with conn.begin():
            unchecked = store.unchecked_groups(conn, self.schema, self.groups)
        for group in self.counts.unchecked.keys() - unchecked.keys():
            UNCHECKED.labels(group).set(0)
        for group, due in unchecked.items():
            UNCHECKED.labels(group).set(due)
            if group not in self._reported:
                self._reported.add(group)
                log.warning(
                    "%d messages of producer group %r are due for a check-back, but this sweeper "
                    "has no checker for it: register one with @outbox.checker(%r) and pass "
                    "--app, or add it to OUTBOX_SQL_CHECKERS (they wait, uncounted)",
                    due, group, group)
        self.counts.unchecked = unchecked


#: In a connection's ``info`` while a checker holds it: if the checker closes it, it goes
#: back to the pool unreset, and :func:`_end_unreset` ends its session there.
_LENT = "outbox_lent_to_checker"


def _reset(conn: Connection, schema: str) -> None:
    """End the check's transaction and reset its session (DISCARD ALL). A checker that
    closed or broke the connection it was lent has answered all the same: its answer
    stands, and the connection is discarded."""
    try:
        conn.rollback()
        store.reset_session(conn, schema)
    except (SQLAlchemyError, psycopg.Error):
        _discard(conn)
    else:
        conn.info.pop(_LENT, None)  # (a new session, if the checker invalidated its own)


def _reused(exc: BaseException) -> bool:
    """Whether ``exc`` is psycopg's refusal of a statement on a connection already closed:
    closed by the checker (or broken by an error it swallowed), not lost by this statement."""
    cause = getattr(exc, "orig", exc)
    return (isinstance(cause, psycopg.OperationalError) and cause.sqlstate is None
            and str(cause) == "the connection is closed")


def _discard(conn: Connection) -> None:
    """Close the check's session for good, rather than let the pool hand it out again.
    One the checker closed is already back in the pool: :func:`_end_unreset` ended it."""
    if not conn.closed:
        conn.invalidate()


def _end_unreset(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    """On the pool's checkin: end a session a checker closed (``with conn:``) before the
    sweeper could reset it, whatever it left there (advisory locks, settings)."""
    if record.info.pop(_LENT, False):
        record.invalidate()


def _say(recorded: list[Any]) -> None:
    """Log what recorded checks ended: a message discarded, or resolved."""
    for row in recorded:
        if row.status == Status.DISCARDED:
            log.warning("message %d (producer group %r) discarded after %d inconclusive "
                        "check-back%s; `outbox resume %d` checks it again", row.id,
                        row.producer_group, row.check_count,
                        "" if row.check_count == 1 else "s", row.id)
        elif row.resolution != Resolution.UNKNOWN:
            log.info("message %d (producer group %r) resolved %s by check-back %d",
                     row.id, row.producer_group, row.resolution, row.check_count)


def _timed_out(seconds: float) -> str:
    return f"checker timed out after {seconds:g} s"
