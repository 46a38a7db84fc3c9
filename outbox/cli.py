"""The ``outbox`` command line: database migrations, the relay, and the embedded services."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError

from outbox.encoding import MAX_MESSAGE_ID, ascii_digits
from outbox.entry import stop_before_start
from outbox.exceptions import (
    INSUFFICIENT_PRIVILEGE,
    LOCK_NOT_AVAILABLE,
    READ_ONLY_TRANSACTION,
    ConfigurationError,
    OutboxError,
    db_command,
    first_line,
    lock_wait_exceeded,
    read_only,
    setup_error,
    sqlstate,
)
from outbox.settings import (
    CONFIG_ENV,
    ConsoleSettings,
    DatabaseSettings,
    KafkaSettings,
    MigrateSettings,
    PruneSettings,
    ReconcileSettings,
    RelaySettings,
    Settings,
    StatusSettings,
    SweepSettings,
    load_settings,
    mask_url,
    unknown_variables,
)

if TYPE_CHECKING:
    from outbox.spark.reconcile import Result

DEFAULT_STATE = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"),
                     "outbox", "dev-services.json")
#: A folder given as the state file was a traceback (IsADirectoryError).
STATE_FILE = click.Path(dir_okay=False, path_type=Path)
S = TypeVar("S", bound=DatabaseSettings)
#: SQLSTATE of a write refused by a server in recovery (a standby).
#: The shortest console token taken: one an operator can guess (or one space) is refused.
MIN_TOKEN_LENGTH = 16


class _MessageId(click.IntRange):
    name = "message id"  # click's own said "'abc' is not a valid integer range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> Any:
        """ASCII digits only, as on the console: click read an id with ``int()``, so
        ``resume 1_2`` (a typo) resumed message 12, and full-width or Arabic-Indic digits,
        blanks and a sign were taken too."""
        if isinstance(value, str) and not ascii_digits(value):
            self.fail(f"{value!r} is not a valid message id (digits 0-9).", param, ctx)
        return super().convert(value, param, ctx)


MESSAGE_ID = _MessageId(1, MAX_MESSAGE_ID)


@dataclass
class Shared:
    """The group's options, for every command (``click`` context object)."""

    database_url: str | None = None
    schema: str | None = None
    #: The database URL and schema the command actually uses, for error lines (the URL
    #: masked there).
    used_url: str = ""
    used_schema: str = "outbox"

    def settings(self, cls: type[S], *, require_database: bool = True, **overrides: Any) -> S:
        """``cls`` from the group's options, the command's own ``overrides``, then OUTBOX_*."""
        settings = load_settings(cls, database_url=self.database_url, schema=self.schema,
                                 **overrides)
        self.used_url, self.used_schema = settings.database_url, settings.schema_name
        if require_database:
            if isinstance(settings, KafkaSettings):
                settings.kafka_security()  # a TLS file missing is named before any wait
            settings.require("database_url")
            from outbox.pooling import refuse_transaction_pooling

            refuse_transaction_pooling(settings.sqlalchemy_url,
                                       click.get_current_context().command_path)
        return settings


#: The commands that take SIGTERM, Ctrl-C and SIGHUP over themselves from their start: the
#: daemons and a reconciliation (its Spark jobs). The console does once it serves.
OWN_SIGNALS = frozenset({"relay", "sweep", "reconcile"})
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: ``ctx.meta`` key (shared by a command's nested contexts): what a short command stopped
#: by a signal left behind, said after the signal's name.
ON_STOP, COMMAND = "outbox.on_stop", "outbox.command"


class Stopped(KeyboardInterrupt):
    """SIGTERM, Ctrl-C or SIGHUP in a short command, raised where the command is, as Ctrl-C's
    KeyboardInterrupt: psycopg cancels the statement in hand, and every ``with`` block rolls
    its transaction back and closes on the way out. SIGTERM killed such a command without a
    word (exit 143), Ctrl-C said 'Aborted!' with exit code 1 (for resume: ids not resumed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    for each in STOP_SIGNALS:  # the way out (a rollback, services stopped) is not cut short
        signal.signal(each, signal.SIG_IGN)
    raise Stopped(signum)


def on_stop(consequence: str) -> None:
    """Say ``consequence`` (what is left) if a signal stops the running command from now."""
    click.get_current_context().meta[ON_STOP] = consequence


class OutboxCommand(click.Command):
    """A command that names itself (``db upgrade``) for the line of a stop."""

    def invoke(self, ctx: click.Context) -> Any:
        names: list[str] = []
        each = ctx
        while each.parent is not None:
            names.insert(0, each.info_name or "")
            each = each.parent
        ctx.meta[COMMAND] = " ".join(names)
        return super().invoke(ctx)


class OutboxSubgroup(click.Group):
    command_class = OutboxCommand


class OutboxGroup(click.Group):
    """Errors a user can fix become one line on stderr and exit code 2, never a traceback;
    a short command stopped by a signal says so in one line and exits 128 + the signal."""

    command_class = OutboxCommand
    group_class = OutboxSubgroup

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if ctx.invoked_subcommand in OWN_SIGNALS:
                raise
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            click.echo(f"outbox: error: {ctx.meta.get(COMMAND, 'the command')} was "
                       f"stopped ({signal.Signals(signum).name})"
                       f"{ctx.meta.get(ON_STOP, ': it changed nothing')}", err=True)
            ctx.exit(128 + signum)
        except Exception as exc:
            line = error_line(ctx, exc)
            if line is None:
                raise
            click.echo(line, err=True)
            ctx.exit(2)


def error_line(ctx: click.Context, exc: Exception) -> str | None:
    """The one line for an error a user can fix; None for a bug (a traceback)."""
    shared = ctx.obj if isinstance(ctx.obj, Shared) else Shared()
    url = mask_url(shared.used_url)
    if isinstance(exc, OutboxError):
        return f"outbox: error: {exc}"
    if isinstance(exc, OperationalError | psycopg.OperationalError):  # the pooler probe's
        return f"outbox: error: cannot use PostgreSQL at {url}: {first_line(exc)}"
    if isinstance(exc, DBAPIError) and sqlstate(exc) == READ_ONLY_TRANSACTION:
        return f"outbox: error: {read_only(url)}"
    if isinstance(exc, DBAPIError) and sqlstate(exc) == INSUFFICIENT_PRIVILEGE \
            and ctx.invoked_subcommand == "db":  # setup_error's hint would name this command
        return (f"outbox: error: this login may not migrate schema {shared.used_schema} "
                f"({first_line(exc)}): run `outbox db` as the role that owns the schema, or "
                "one with CREATE on the database (docs/operations.md, \"Least-privilege "
                "roles\")")
    if isinstance(exc, DBAPIError):
        hint = setup_error(exc, shared.used_schema)
        return None if hint is None else f"outbox: error: {hint}"
    return None


def short_session() -> dict[str, str]:
    """The session settings of a short command's connections: its wait for a lock is
    bounded by :data:`LOCK_WAIT_SECONDS` (a command that printed nothing for as long as an
    upgrade ran looked hung)."""
    from outbox import store

    return dict(store.SHORT_SESSION_SETTINGS)


@contextlib.contextmanager
def database(settings: DatabaseSettings) -> Iterator[Connection]:
    """One connection for a short command, its engine disposed afterwards, to a schema at
    the code's revision (against an older one, discarded and resume said there was nothing,
    prune that a function was missing). A lock not granted within :func:`short_session`'s
    wait, in it or in the ``with`` block, is one line naming who holds the schema's locks."""
    from outbox import store
    from outbox.migrate import require_current

    engine = store.engine(settings.sqlalchemy_url, settings=short_session())
    try:
        with engine.connect() as conn:
            require_current(conn, settings.schema_name)
            conn.rollback()
            yield conn
    except DBAPIError as exc:
        if sqlstate(exc) != LOCK_NOT_AVAILABLE:
            raise
        with engine.connect() as conn:
            holders = store.lock_holders(conn, settings.schema_name)
        raise OutboxError(f"{lock_wait_exceeded(settings.schema_name, holders)}: try again "
                          "when it ends") from exc
    finally:
        engine.dispose()


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # kafka-python logs every failed connection attempt; the relay reports outages itself.
    logging.getLogger("kafka").setLevel(
        logging.DEBUG if level.upper() == "DEBUG" else logging.CRITICAL)
    # Spark's Python bridge logs its connection's close at exit, after a run's last line.
    logging.getLogger("py4j").setLevel(
        logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING)


kafka_bootstrap_option = click.option(
    "--kafka-bootstrap", help="Kafka host:port,... [env OUTBOX_KAFKA_BOOTSTRAP]")
log_level_option = click.option("--log-level", help="DEBUG, INFO, WARNING [env OUTBOX_LOG_LEVEL]")
pass_shared = click.make_pass_decorator(Shared)


@click.group(cls=OutboxGroup)
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML file of settings (below flags and OUTBOX_* variables) "
                   "[env OUTBOX_CONFIG]")
@click.option("--database-url", help="PostgreSQL URL [env OUTBOX_DATABASE_URL]")
@click.option("--schema", help="schema of the outbox tables [env OUTBOX_SCHEMA; outbox]")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, database_url: str | None,
         schema: str | None) -> None:
    """Transactional outbox on PostgreSQL, relayed to Kafka."""
    if config_file:
        os.environ[CONFIG_ENV] = config_file
    for warning in unknown_variables(os.environ):
        click.echo(f"outbox: warning: {warning}", err=True)
    ctx.obj = Shared(database_url=database_url, schema=schema)
    if ctx.invoked_subcommand not in OWN_SIGNALS \
            and threading.current_thread() is threading.main_thread():
        found = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}
        ctx.call_on_close(lambda: [signal.signal(signum, handler)
                                   for signum, handler in found.items() if handler is not None])


@main.command("config")
@kafka_bootstrap_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_shared
def show_config(shared: Shared, kafka_bootstrap: str | None, as_json: bool) -> None:
    """Print the effective settings, passwords masked."""
    import json

    settings = shared.settings(Settings, require_database=False,
                               kafka_bootstrap=kafka_bootstrap)
    values = settings.masked()
    if as_json:
        click.echo(json.dumps(values, default=str, sort_keys=True))
        return
    for name in sorted(values):
        click.echo(f"{name} = {values[name]!r}")


@main.group()
def db() -> None:
    """Migrate the outbox tables (Alembic, own version table)."""


def _migrate(shared: Shared, direction: str, revision: str) -> DatabaseSettings:
    from outbox import migrate

    settings = shared.settings(MigrateSettings)
    on_stop(f": a migration not yet committed was rolled back, whole (`outbox db current` "
            f"prints the revision schema {settings.schema_name} is at)")
    if direction == "upgrade":  # its first ranges of history are partition_size ids each
        migrate.upgrade(settings.sqlalchemy_url, settings.schema_name, revision,
                        settings.partition_size)
    else:
        migrate.downgrade(settings.sqlalchemy_url, settings.schema_name, revision)
    now = migrate.current(settings.sqlalchemy_url, settings.schema_name)
    click.echo(f"schema {settings.schema_name} is at revision {now or 'base (no outbox tables)'}")
    return settings


@db.command()
@click.option("--revision", default="head", show_default=True)
@click.option("--create-roles", is_flag=True,
              help="also create the least-privilege roles <schema>_app, _relay, _sweeper, "
              "_reconcile, _checker, _console")
@pass_shared
def upgrade(shared: Shared, revision: str, create_roles: bool) -> None:
    """Create or upgrade the outbox tables."""
    settings = _migrate(shared, "upgrade", revision)
    if create_roles:
        from outbox import migrate

        try:
            roles = migrate.create_roles(settings.sqlalchemy_url, settings.schema_name)
        except DBAPIError as exc:  # it said the login may not migrate the schema it just had
            if sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
                raise
            raise ConfigurationError(
                f"schema {settings.schema_name} is migrated, but this login may not create "
                f"its roles ({first_line(exc)}): run "
                f"`{db_command(settings.schema_name, 'upgrade --create-roles')}` as a "
                "superuser or a role with CREATEROLE (docs/operations.md, \"Least-privilege "
                "roles\")") from None
        click.echo(f"roles {', '.join(roles)} granted; GRANT them to your login roles")
        for grant in migrate.missing_grants(settings.sqlalchemy_url, settings.schema_name):
            click.echo(f"outbox: warning: this role may not grant what {settings.schema_name}"
                       f"_reconcile needs (outbox reconcile refuses to run under it until "
                       f"then); a superuser must run: {grant}", err=True)


@db.command(context_settings={"ignore_unknown_options": True})  # -1 is a REVISION
@click.argument("revision")
@pass_shared
def downgrade(shared: Shared, revision: str) -> None:
    """Downgrade the outbox tables to REVISION ('-1' is one back, 'base' removes them)."""
    _migrate(shared, "downgrade", revision)


@db.command()
@pass_shared
def current(shared: Shared) -> None:
    """Print the applied revision ("(none)" when not migrated)."""
    from outbox import migrate

    settings = shared.settings(DatabaseSettings)
    click.echo(migrate.current(settings.sqlalchemy_url, settings.schema_name) or "(none)")


@main.command()
@kafka_bootstrap_option
@click.option("--batch-size", type=int, help="messages per batch [env OUTBOX_RELAY_BATCH_SIZE]")
@click.option("--poll-interval", type=float,
              help="seconds between polls without NOTIFY [env OUTBOX_RELAY_POLL_INTERVAL]")
@click.option("--lease-seconds", type=float,
              help="shard lease length [env OUTBOX_RELAY_LEASE_SECONDS]")
@click.option("--metrics-port", type=int,
              help="serve Prometheus metrics on this port [env OUTBOX_RELAY_METRICS_PORT]")
@log_level_option
@pass_shared
def relay(shared: Shared, kafka_bootstrap: str | None, batch_size: int | None,
          poll_interval: float | None, lease_seconds: float | None, metrics_port: int | None,
          log_level: str | None) -> None:
    """Deliver committed messages to Kafka until SIGTERM or Ctrl-C."""
    stop_before_start("relay")  # set by outbox.entry too, unless main() was called directly
    from outbox.relay.daemon import run_until_signalled, serve_metrics
    from outbox.relay.relay import Relay

    settings = shared.settings(
        RelaySettings, kafka_bootstrap=kafka_bootstrap, relay_batch_size=batch_size,
        relay_poll_interval=poll_interval, relay_lease_seconds=lease_seconds,
        relay_metrics_port=metrics_port, log_level=log_level,
    )
    setup_logging(settings.log_level)
    daemon = Relay(settings)
    if settings.relay_metrics_port is not None:
        serve_metrics(settings.relay_metrics_port, logging.getLogger("outbox.relay"))
    run_until_signalled(daemon)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_shared
def status(shared: Shared, as_json: bool) -> None:
    """Pending, in flight, parked, delayed and recent deliveries, per topic and relay."""
    import json

    from outbox import store

    settings = shared.settings(StatusSettings)
    with database(settings) as conn:
        topics = store.status_by_topic(conn, settings.schema_name)
        relays = store.relays(conn, settings.schema_name, settings.relay_lease_seconds)
        check_backs = store.check_backlog(conn, settings.schema_name, _overdue(settings))
    in_flight = sum(r["in_flight"] for r in relays)
    if as_json:
        click.echo(json.dumps({"schema": settings.schema_name, "in_flight": in_flight,
                               "topics": topics, "relays": relays,
                               "check_backs": check_backs}, default=float))
        return
    click.echo(f"schema {settings.schema_name}: {len(relays)} relays alive, "
               f"{in_flight} messages in flight")
    for relay_row in relays:
        paused = ("" if relay_row["paused_seconds"] is None else
                  f", paused for {float(relay_row['paused_seconds']):.0f}s: "
                  f"{relay_row['paused_reason']}")
        click.echo(f"  relay {relay_row['worker_id']}: {relay_row['shards']} shards, "
                   f"{relay_row['in_flight']} in flight{paused}")
    _print_topics(topics)
    for held in (t for t in topics if t["held"]):
        reason = held["held_reason"]
        until = ("Kafka knows the topic (create it; " if reason.startswith("Kafka has no metadata")
                 else f"Kafka describes the topic to the relay ({reason}; "
                 if reason.startswith("Kafka will not describe")
                 else f"Kafka accepts them ({reason}; ")
        click.echo(f"topic {held['topic']} held: {held['held']} messages wait until {until}"
                   "OUTBOX_TOPIC_HOLD_PARK_AFTER parks them)")
    for group in check_backs:
        overdue = (f", {group['overdue']} overdue: is a sweeper with a checker for this group "
                   "running, and are its checks not stuck past their timeout "
                   "(outbox_checks_stuck)?" if group["overdue"] else "")
        click.echo(f"producer group {group['producer_group']}: {group['unresolved']} awaiting "
                   f"their check-back{overdue}")


def _print_topics(topics: list[dict[str, Any]]) -> None:
    columns = ["pending", "unresolved", "delayed", "parked", "discarded",
               "delivered_last_minute"]
    header = ["topic", *[c.replace("delivered_last_minute", "delivered/min") for c in columns],
              "oldest undelivered"]
    rows = [[t["topic"], *[str(t[c]) for c in columns],
             "-" if t["oldest_undelivered_seconds"] is None
             else f"{float(t['oldest_undelivered_seconds']):.1f}s"] for t in topics]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for line in [header, *rows]:
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))
    if not rows:
        click.echo("(no undelivered messages and no deliveries in the last minute)")


def _overdue(settings: StatusSettings) -> float:
    """How long past due an UNKNOWN message may wait before a working sweeper claims it."""
    from outbox.relay.sweeper import CLAIM_MARGIN

    return settings.checker_timeout + CLAIM_MARGIN + settings.sweep_poll_interval


@main.command()
@click.option("--retention-hours", type=float, help="[env OUTBOX_RETENTION_HOURS; 72]")
@pass_shared
def prune(shared: Shared, retention_hours: float | None) -> None:
    """Drop partitions of delivered and rolled-back rows and op records older than the
    retention (one pass of the relay's retention)."""
    from outbox.relay.retention import prune as prune_all

    settings = shared.settings(PruneSettings, retention_hours=retention_hours)
    on_stop(": the ranges and rows it pruned stay pruned, the others are kept for the next "
            "pass")
    with database(settings):  # refuses a schema behind the code, names a lock's holder
        pruned = prune_all(settings, session=short_session())
    click.echo(pruned.summary(settings.retention_hours))


@main.group()
def dev() -> None:
    """Throwaway PostgreSQL and Kafka-protocol broker on loopback."""


@dev.command()
@click.option("--state-file", type=STATE_FILE, default=DEFAULT_STATE,
              show_default=True, help="where to record what was started")
@click.option("--durable/--fast", default=False,
              help="keep PostgreSQL's fsync on (for benchmarks); default off")
def up(state_file: Path, durable: bool) -> None:
    """Start the services and print the OUTBOX_* settings to export; start again those
    recorded that were killed (on their ports, PostgreSQL with its data)."""
    from outbox.dev import services as devservices

    services = devservices.Services.load(state_file) if state_file.exists() else None
    if services is not None and not services.exists():
        click.echo(f"# the services recorded in {state_file} are gone with their folder "
                   f"{services.root}: starting new ones", err=True)
        services = None
    if services is not None:
        on_stop(f" while it started again the services recorded in {state_file}: it stopped "
                "those again (PostgreSQL's data is kept); `outbox dev up` starts them")
        restarted = devservices.resume(services)  # stops them again on a signal
        if not restarted:
            raise ConfigurationError(
                f"services already recorded in {state_file}: `outbox dev env` prints their "
                "settings again, `outbox dev down` stops them")
        _record(services, state_file, restarted)
        click.echo(f"# restarted the embedded {' and '.join(restarted)} recorded in "
                   f"{state_file}" + ("; the broker's topics were in memory and are gone"
                                      if "Kafka broker" in restarted else ""), err=True)
    else:
        on_stop(" while it started the services: it stopped them again and removed their "
                "folder")
        services = devservices.start(durable=durable, keep=True)  # stops them on a signal
        _record(services, state_file)
        on_stop(f": the services are recorded in {state_file}")
    click.echo(f"# PostgreSQL on port {services.pg_port}, Kafka on port {services.kafka_port}; "
               f"files in {services.root}", err=True)
    _exports(services)


@dev.command()
@click.option("--state-file", type=STATE_FILE, default=DEFAULT_STATE,
              show_default=True)
def env(state_file: Path) -> None:
    """Print the OUTBOX_* settings of what `outbox dev up` started (for another shell)."""
    from outbox.dev import services as devservices

    if not state_file.exists():
        raise ConfigurationError(f"nothing recorded in {state_file}: run `outbox dev up`")
    services = devservices.Services.load(state_file)
    for name in devservices.not_running(services):
        click.echo(f"# the embedded {name} recorded there is not running: `outbox dev up` "
                   "starts it again", err=True)
    _exports(services)


def _record(services: Any, state_file: Path, restarted: list[str] | None = None) -> None:
    """Record new ``services`` (or those ``restarted``) in ``state_file``, or stop them:
    unrecorded, no ``outbox dev down`` could (a full disk gave a traceback and left the
    servers running)."""
    from outbox.dev import services as devservices

    try:
        services.save(state_file)
    except BaseException as exc:
        if restarted is None:
            devservices.stop(services)
        else:
            devservices.halt(services, restarted)
        if not isinstance(exc, OSError):
            raise
        again = ("them again; free some room there or give another --state-file"
                 if restarted is None else
                 f"the {' and '.join(restarted)} again (PostgreSQL's data is kept); free "
                 "some room there and run `outbox dev up` again")
        raise ConfigurationError(f"cannot record the services in {state_file} "
                                 f"({exc.strerror or exc}): stopped {again}") from None


def _exports(services: Any) -> None:
    for name, value in services.env().items():
        click.echo(f"export {name}={value}")


@dev.command()
@click.option("--state-file", type=STATE_FILE, default=DEFAULT_STATE,
              show_default=True)
def down(state_file: Path) -> None:
    """Stop exactly what `outbox dev up` started."""
    from outbox.dev import services as devservices

    if not state_file.exists():
        click.echo(f"nothing recorded in {state_file}; nothing to stop", err=True)
        return
    on_stop(f": it may have stopped some of them; `outbox dev down` again stops the others "
            f"recorded in {state_file}")
    stopped = devservices.stop(devservices.Services.load(state_file))
    state_file.unlink()
    if stopped:
        click.echo(f"stopped the embedded {' and '.join(stopped)}", err=True)
    else:
        click.echo(f"nothing recorded in {state_file} was running (stopped by a reboot or a "
                   "kill); forgot it", err=True)


@main.command()
@click.argument("ids", nargs=-1, type=MESSAGE_ID)
@click.option("--all", "resume_all", is_flag=True, help="every PARKED and DISCARDED message")
@pass_shared
def resume(shared: Shared, ids: tuple[int, ...], resume_all: bool) -> None:
    """Re-queue PARKED messages and re-arm the check-backs of DISCARDED ones."""
    from outbox import store

    if not ids and not resume_all:
        raise click.UsageError("give message ids, or --all")
    if ids and resume_all:  # ran as --all, and said the ids were not resumed
        raise click.UsageError("give message ids or --all, not both")
    settings = shared.settings(DatabaseSettings)
    on_stop(": its transaction was rolled back, nothing was resumed")
    with database(settings) as conn, conn.begin():
        resumed = store.resume(conn, settings.schema_name, f"cli:{settings.worker_id}",
                               ids, resume_all=resume_all)
    on_stop(f": {len(resumed)} messages were resumed")
    for message_id, was in resumed:
        click.echo(f"resumed message {message_id} (was {was})")
    missing = set(ids) - {message_id for message_id, _ in resumed}
    if missing:
        click.echo(f"not resumed (unknown, or neither PARKED nor DISCARDED): "
                   f"{', '.join(map(str, sorted(missing)))}", err=True)
        sys.exit(1)
    if not resumed:
        click.echo("nothing to resume", err=True)


@main.command()
@click.option("--app", "app_path",
              help="module:attribute of your Outbox; its @outbox.checker functions answer")
@click.option("--check-interval", type=float,
              help="seconds between check-backs [env OUTBOX_CHECK_INTERVAL; 30]")
@click.option("--check-max", type=int,
              help="inconclusive check-backs before discarding [env OUTBOX_CHECK_MAX; 15]")
@click.option("--checker-timeout", type=float,
              help="seconds a checker may take [env OUTBOX_CHECKER_TIMEOUT; 5]")
@click.option("--concurrency", type=int,
              help="checks run at once [env OUTBOX_SWEEP_CONCURRENCY; 8]")
@click.option("--metrics-port", type=int,
              help="serve Prometheus metrics on this port [env OUTBOX_SWEEP_METRICS_PORT]")
@log_level_option
@pass_shared
def sweep(shared: Shared, app_path: str | None, check_interval: float | None,
          check_max: int | None, checker_timeout: float | None, concurrency: int | None,
          metrics_port: int | None, log_level: str | None) -> None:
    """Check back UNKNOWN messages with their producer group's checker, until SIGTERM.

    Checkers come from --app (Python) and OUTBOX_SQL_CHECKERS (SQL queries, as JSON).
    """
    stop_before_start("sweeper")
    from outbox.relay.daemon import run_until_signalled, serve_metrics
    from outbox.relay.sweeper import Sweeper, load_app

    settings = shared.settings(
        SweepSettings, check_interval=check_interval, check_max=check_max,
        checker_timeout=checker_timeout, sweep_concurrency=concurrency,
        sweep_metrics_port=metrics_port, log_level=log_level,
    )
    setup_logging(settings.log_level)
    daemon = Sweeper(settings, load_app(app_path).checkers if app_path else {})
    if settings.sweep_metrics_port is not None:
        serve_metrics(settings.sweep_metrics_port, logging.getLogger("outbox.sweeper"))
    try:
        run_until_signalled(daemon)
    except Exception as exc:
        if not daemon.stuck:
            raise
        line = error_line(click.get_current_context(), exc)
        click.echo(line or "".join(traceback.format_exception(exc)), err=True)
        _exit_leaving_threads(2 if line else 1)
    if daemon.stuck:
        _exit_leaving_threads(0)


def _exit_leaving_threads(code: int) -> NoReturn:
    """Exit now: the threads of checks stuck past their timeout would be joined at exit, for
    ever (Python cannot stop a thread)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@main.command()
@click.option("--limit", type=click.IntRange(1, MAX_MESSAGE_ID), default=100, show_default=True)
@pass_shared
def discarded(shared: Shared, limit: int) -> None:
    """List messages discarded after their last inconclusive check-back."""
    from outbox import store

    settings = shared.settings(DatabaseSettings)
    with database(settings) as conn:
        rows = store.discarded(conn, settings.schema_name, min(limit, MAX_MESSAGE_ID - 1) + 1)
    if not rows:
        click.echo("no discarded messages", err=True)
        return
    more, rows = len(rows) > limit, rows[:limit]
    for row in rows:
        key = "-" if row.key is None else row.key.decode(errors="replace")
        when = f"{row.discarded_at:%Y-%m-%d %H:%M:%S%z}" if row.discarded_at else "?"
        click.echo(f"{row.id}\tgroup={row.producer_group}\ttopic={row.topic}\tkey={key}\t"
                   f"discarded {when}\t{row.detail or ''}")
    shown = f"the oldest {len(rows)} of more (--limit)" if more else str(len(rows))
    click.echo(f"{shown} discarded; `outbox resume ID ...` checks them again", err=True)


@main.command()
@click.option("--host", help="address to listen on [env OUTBOX_CONSOLE_HOST; 127.0.0.1]")
@click.option("--port", type=int, help="port [env OUTBOX_CONSOLE_PORT; 8089]")
@click.option("--allow-actions", is_flag=True, default=None,
              help="offer resume actions, which need OUTBOX_CONSOLE_TOKEN "
              "[env OUTBOX_CONSOLE_ACTIONS; read-only]")
@log_level_option
@pass_shared
def console(shared: Shared, host: str | None, port: int | None, allow_actions: bool | None,
            log_level: str | None) -> None:
    """Serve the operator console (backlog, relays, deliveries, parked and discarded
    messages, reconciliation runs) until SIGTERM or Ctrl-C."""
    try:
        from outbox.console.app import serve
    except ImportError as exc:
        raise ConfigurationError(
            f"console needs the console extra ({exc}): pip install "
            "'transactional-outbox[console]'") from None

    try:
        settings = shared.settings(ConsoleSettings, console_host=host, console_port=port,
                                   console_actions=allow_actions, log_level=log_level)
        token = settings.console_token.get_secret_value().strip()
        if settings.console_actions and len(token) < MIN_TOKEN_LENGTH:
            short = f" of {MIN_TOKEN_LENGTH} characters or more" if token else ""
            raise ConfigurationError(
                f"--allow-actions needs a token{short}: set OUTBOX_CONSOLE_TOKEN to a long "
                "random string (operators type it to resume messages)")
        setup_logging(settings.log_level)
        serve(settings, _overdue(settings))
    except KeyboardInterrupt as exc:  # before it served it holds nothing: exit 0, as a relay
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        click.echo(f"outbox: console stopped before it served ({signal.Signals(signum).name})",
                   err=True)


def _timestamp(_ctx: click.Context, _param: click.Parameter, value: str | None
               ) -> datetime | None:
    """ISO 8601; a time without an offset is UTC."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 time, e.g. 2026-11-22T08:00:00+00:00") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _thresholds(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
                ) -> dict[str, int | None]:
    parsed: dict[str, int | None] = {}
    for value in values:
        name, _, limit = value.partition("=")
        if not limit or not (ascii_digits(limit) or limit == "none"):
            raise click.BadParameter(f"{value!r}: use FINDING=N or FINDING=none")
        parsed[name.strip()] = None if limit == "none" else int(limit)
    return parsed


@main.command()
@kafka_bootstrap_option
@click.option("--since", callback=_timestamp,
              help="window start, ISO 8601 [default: where the last run ended]")
@click.option("--until", callback=_timestamp,
              help="window end, ISO 8601 [default: now minus the SLA]")
@click.option("--read-topics/--tables-only", default=None,
              help="also read the Kafka topics [env OUTBOX_RECONCILE_READ_TOPICS; tables only]")
@click.option("--output-dir", help="folder for the runs' files "
              "[env OUTBOX_RECONCILE_OUTPUT_DIR; reconcile-output]")
@click.option("--sla-seconds", type=float, help="a committed message undelivered this long "
              "after it was due is a finding [env OUTBOX_RECONCILE_SLA_SECONDS; 300]")
@click.option("--threshold", "thresholds", multiple=True, callback=_thresholds,
              metavar="FINDING=N|none", help="fail when more than N of FINDING are found; "
              "'none' only reports it (repeatable) [env OUTBOX_RECONCILE_THRESHOLDS, JSON]")
@click.option("--partitions", type=int,
              help="parallel JDBC reads per table at most; one per core of the "
              "session unless a read would pass 2.5M rows [env OUTBOX_RECONCILE_PARTITIONS; 8]")
@click.option("--master", help="Spark master [env OUTBOX_RECONCILE_SPARK_MASTER; "
              "spark-submit's, else local[*]]")
@log_level_option
@pass_shared
def reconcile(shared: Shared, kafka_bootstrap: str | None, since: datetime | None,
              until: datetime | None, read_topics: bool | None, output_dir: str | None,
              sla_seconds: float | None,
              thresholds: dict[str, int | None], partitions: int | None, master: str | None,
              log_level: str | None) -> None:
    """Prove every committed message reached Kafka exactly where its op record says.

    Runs a Spark job over the messages created since the last run (or --since/--until),
    prints a short report and writes Parquet details under --output-dir. Exit code 0: no
    finding over its threshold; 1: at least one is; 2: a usage or configuration error;
    3: another run of the schema is in progress, this one did nothing; 4: the job failed as
    it ran (Kafka or the database went away), nothing was recorded; 130, 143: stopped by
    Ctrl-C or SIGTERM, nothing was recorded.
    """
    try:
        from outbox.spark import reconcile as job
    except ImportError as exc:
        raise ConfigurationError(
            f"reconcile needs the spark extra ({exc}): pip install "
            "'transactional-outbox[spark]'") from None

    settings = shared.settings(
        ReconcileSettings, kafka_bootstrap=kafka_bootstrap, reconcile_read_topics=read_topics,
        reconcile_output_dir=output_dir, reconcile_sla_seconds=sla_seconds,
        reconcile_partitions=partitions, reconcile_spark_master=master, log_level=log_level,
    )
    settings = settings.model_copy(update={
        "reconcile_thresholds": {**settings.reconcile_thresholds, **thresholds}})
    setup_logging(settings.log_level)
    with job.stopped_by_signals():
        try:
            result = _reconciled(settings, since, until)
        except BaseException:
            signum = job.stopped_by()
            if signum is None:
                raise
            click.echo(f"outbox: error: the reconciliation was stopped "
                       f"({signal.Signals(signum).name}): nothing was recorded; the next run "
                       "reads the same window", err=True)
            sys.exit(128 + signum)
    click.echo(result.report, nl=False)
    sys.exit(result.exit_code)


def _reconciled(settings: ReconcileSettings, since: datetime | None, until: datetime | None
                ) -> Result:
    """The run's result; exits 3 or 4 with one line when it could not run or failed."""
    from outbox.spark import reconcile as job
    from outbox.spark.runs import RunInProgress

    job.preflight(settings, since=since, until=until)
    with job.session(settings) as spark:
        job.stop_on_signals()
        try:
            return job.run(spark, settings, since=since, until=until)
        except RunInProgress as exc:
            click.echo(f"outbox: {exc}", err=True)
            sys.exit(3)
        except Exception as exc:
            cause = job.job_failure(exc)
            if cause is None or job.stopped_by() is not None:
                raise
            click.echo("outbox: error: the reconciliation job failed as it ran (nothing was "
                       f"recorded; the next run reads the same window): {cause}", err=True)
            sys.exit(4)
