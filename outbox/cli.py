"""The ``outbox`` command line: database migrations, the relay, and the embedded services."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from outbox.exceptions import ConfigurationError, OutboxError
from outbox.settings import CONFIG_ENV, Settings, load_settings, mask_url

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_STATE = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"),
                     "outbox", "dev-services.json")


def settings_options(func: F) -> F:
    """The options every command shares; unset ones fall back to OUTBOX_* variables."""
    options = [
        click.option("--database-url", help="PostgreSQL URL [env OUTBOX_DATABASE_URL]"),
        click.option("--kafka-bootstrap", help="Kafka host:port,... [env OUTBOX_KAFKA_BOOTSTRAP]"),
        click.option("--schema", help="schema of the outbox tables [env OUTBOX_SCHEMA; outbox]"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def friendly_errors(func: F) -> F:
    """One line on stderr and exit code 2 for errors a user can fix; no traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OutboxError as exc:
            click.echo(f"outbox: error: {exc}", err=True)
            sys.exit(2)
        except OperationalError as exc:
            url = kwargs.get("database_url") or os.environ.get("OUTBOX_DATABASE_URL", "")
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            click.echo(f"outbox: error: cannot use PostgreSQL at {mask_url(url)}: {reason}",
                       err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def database(settings: Settings) -> Iterator[Connection]:
    """One connection for a short command, its engine disposed afterwards."""
    from sqlalchemy import create_engine

    engine = create_engine(settings.sqlalchemy_url)
    try:
        with engine.connect() as conn:
            yield conn
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


@click.group()
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML file of settings (below flags and OUTBOX_* variables) "
                   "[env OUTBOX_CONFIG]")
def main(config_file: str | None) -> None:
    """Transactional outbox on PostgreSQL, relayed to Kafka."""
    if config_file:
        os.environ[CONFIG_ENV] = config_file


@main.command("config")
@settings_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly_errors
def show_config(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
                as_json: bool) -> None:
    """Print the effective settings, passwords masked."""
    import json

    settings = load_settings(database_url=database_url, kafka_bootstrap=kafka_bootstrap,
                             schema=schema)
    values = settings.masked()
    if as_json:
        click.echo(json.dumps(values, default=str, sort_keys=True))
        return
    for name in sorted(values):
        click.echo(f"{name} = {values[name]!r}")


@main.group()
def db() -> None:
    """Migrate the outbox tables (Alembic, own version table)."""


def _db_settings(database_url: str | None, schema: str | None) -> Settings:
    settings = load_settings(database_url=database_url, schema=schema)
    settings.require("database_url")
    return settings


def _migrate(direction: str, database_url: str | None, schema: str | None, revision: str
             ) -> None:
    from outbox import migrate

    settings = _db_settings(database_url, schema)
    getattr(migrate, direction)(settings.database_url, settings.schema_name, revision)
    click.echo(f"schema {settings.schema_name} is at revision "
               f"{migrate.current(settings.database_url, settings.schema_name)}")


@db.command()
@settings_options
@click.option("--revision", default="head", show_default=True)
@click.option("--create-roles", is_flag=True,
              help="also create the least-privilege roles <schema>_app, _relay, _sweeper")
@friendly_errors
def upgrade(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
            revision: str, create_roles: bool) -> None:
    """Create or upgrade the outbox tables."""
    _migrate("upgrade", database_url, schema, revision)
    if create_roles:
        from outbox import migrate

        settings = _db_settings(database_url, schema)
        roles = migrate.create_roles(settings.database_url, settings.schema_name)
        click.echo(f"roles {', '.join(roles)} granted; GRANT them to your login roles")


@db.command()
@settings_options
@click.argument("revision")
@friendly_errors
def downgrade(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
              revision: str) -> None:
    """Downgrade the outbox tables to REVISION ('base' removes them)."""
    _migrate("downgrade", database_url, schema, revision)


@db.command()
@settings_options
@friendly_errors
def current(database_url: str | None, kafka_bootstrap: str | None, schema: str | None) -> None:
    """Print the applied revision (nothing when not migrated)."""
    from outbox import migrate

    settings = _db_settings(database_url, schema)
    click.echo(migrate.current(settings.database_url, settings.schema_name) or "(none)")


@main.command()
@settings_options
@click.option("--batch-size", type=int, help="messages per batch [env OUTBOX_RELAY_BATCH_SIZE]")
@click.option("--poll-interval", type=float,
              help="seconds between polls without NOTIFY [env OUTBOX_RELAY_POLL_INTERVAL]")
@click.option("--lease-seconds", type=float,
              help="shard lease length [env OUTBOX_RELAY_LEASE_SECONDS]")
@click.option("--metrics-port", type=int,
              help="serve Prometheus metrics on this port [env OUTBOX_RELAY_METRICS_PORT]")
@click.option("--log-level", help="DEBUG, INFO, WARNING [env OUTBOX_LOG_LEVEL]")
@friendly_errors
def relay(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
          batch_size: int | None, poll_interval: float | None, lease_seconds: float | None,
          metrics_port: int | None, log_level: str | None) -> None:
    """Deliver committed messages to Kafka until SIGTERM or Ctrl-C."""
    from relay import metrics
    from relay.relay import Relay

    settings = load_settings(
        database_url=database_url, kafka_bootstrap=kafka_bootstrap, schema=schema,
        relay_batch_size=batch_size, relay_poll_interval=poll_interval,
        relay_lease_seconds=lease_seconds, relay_metrics_port=metrics_port,
        log_level=log_level,
    )
    setup_logging(settings.log_level)
    daemon = Relay(settings)
    if settings.relay_metrics_port is not None:
        metrics.serve(settings.relay_metrics_port)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        again = daemon.stopping.is_set()
        logging.getLogger("outbox.relay").info(
            "%s: %s", signal.Signals(signum).name,
            "abandoning the batch (its messages stay pending)" if again
            else "finishing the current batch, then stopping (signal again to abandon it)",
        )
        daemon.stop(abandon_batch=again)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.run()


@main.command()
@settings_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly_errors
def status(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
           as_json: bool) -> None:
    """Pending, in flight, parked, delayed and recent deliveries, per topic and relay."""
    import json

    from outbox import store
    from outbox.migrate import require_current

    settings = _db_settings(database_url, schema)
    with database(settings) as conn:
        require_current(conn, settings.schema_name)
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
        click.echo(f"  relay {relay_row['worker_id']}: {relay_row['shards']} shards, "
                   f"{relay_row['in_flight']} in flight")
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
    for group in check_backs:
        overdue = (f", {group['overdue']} overdue: is a sweeper with a checker for this group "
                   "running?" if group["overdue"] else "")
        click.echo(f"producer group {group['producer_group']}: {group['unresolved']} awaiting "
                   f"their check-back{overdue}")


def _overdue(settings: Settings) -> float:
    """How long past due an UNKNOWN message may wait before a working sweeper claims it."""
    from relay.sweeper import CLAIM_MARGIN

    return settings.checker_timeout + CLAIM_MARGIN + settings.sweep_poll_interval


@main.command()
@settings_options
@click.option("--retention-hours", type=float, help="[env OUTBOX_RETENTION_HOURS; 72]")
@friendly_errors
def prune(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
          retention_hours: float | None) -> None:
    """Delete delivered and rolled-back rows and op records older than the retention."""
    from relay.retention import prune as prune_all

    settings = load_settings(database_url=database_url, schema=schema,
                             retention_hours=retention_hours)
    settings.require("database_url")
    messages, op_records = prune_all(settings)
    click.echo(f"pruned {messages} messages and {op_records} op records older than "
               f"{settings.retention_hours:g} h")


@main.group()
def dev() -> None:
    """Throwaway PostgreSQL and Kafka-protocol broker on loopback."""


@dev.command()
@click.option("--state-file", type=click.Path(path_type=Path), default=DEFAULT_STATE,
              show_default=True, help="where to record what was started")
@click.option("--durable/--fast", default=False,
              help="keep PostgreSQL's fsync on (for benchmarks); default off")
@friendly_errors
def up(state_file: Path, durable: bool) -> None:
    """Start the services and print the OUTBOX_* settings to export."""
    from outbox import devservices

    if state_file.exists():
        raise click.ClickException(
            f"services already recorded in {state_file}: run `outbox dev down` first")
    services = devservices.start(durable=durable)
    services.save(state_file)
    click.echo(f"# PostgreSQL on port {services.pg_port}, Kafka on port {services.kafka_port}; "
               f"files in {services.root}", err=True)
    for name, value in services.env().items():
        click.echo(f"export {name}={value}")


@dev.command()
@click.option("--state-file", type=click.Path(path_type=Path), default=DEFAULT_STATE,
              show_default=True)
@friendly_errors
def down(state_file: Path) -> None:
    """Stop exactly what `outbox dev up` started."""
    from outbox import devservices

    if not state_file.exists():
        click.echo(f"nothing recorded in {state_file}; nothing to stop", err=True)
        return
    devservices.stop(devservices.Services.load(state_file))
    state_file.unlink()
    click.echo("stopped the embedded PostgreSQL and Kafka broker", err=True)


@main.command()
@settings_options
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "resume_all", is_flag=True, help="every PARKED and DISCARDED message")
@friendly_errors
def resume(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
           ids: tuple[int, ...], resume_all: bool) -> None:
    """Re-queue PARKED messages and re-arm the check-backs of DISCARDED ones."""

    from outbox import store

    if not ids and not resume_all:
        raise click.UsageError("give message ids, or --all")
    settings = _db_settings(database_url, schema)
    with database(settings) as conn, conn.begin():
        resumed = store.resume(conn, settings.schema_name, f"cli:{settings.worker_id}",
                               ids, resume_all=resume_all)
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
@settings_options
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
@click.option("--metrics-port", type=int, help="serve Prometheus metrics on this port")
@click.option("--log-level", help="DEBUG, INFO, WARNING [env OUTBOX_LOG_LEVEL]")
@friendly_errors
def sweep(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
          app_path: str | None, check_interval: float | None, check_max: int | None,
          checker_timeout: float | None, concurrency: int | None, metrics_port: int | None,
          log_level: str | None) -> None:
    """Check back UNKNOWN messages with their producer group's checker, until SIGTERM.

    Checkers come from --app (Python) and OUTBOX_SQL_CHECKERS (SQL queries, as JSON).
    """
    from relay.sweeper import Sweeper, load_app

    settings = load_settings(
        database_url=database_url, schema=schema, check_interval=check_interval,
        check_max=check_max, checker_timeout=checker_timeout, sweep_concurrency=concurrency,
        log_level=log_level,
    )
    setup_logging(settings.log_level)
    daemon = Sweeper(settings, load_app(app_path).checkers if app_path else {})
    if metrics_port is not None:
        from relay import metrics

        metrics.serve(metrics_port)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger("outbox.sweeper").info("%s: stopping", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.run()


@main.command()
@settings_options
@click.option("--limit", type=int, default=100, show_default=True)
@friendly_errors
def discarded(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
              limit: int) -> None:
    """List messages discarded after their last inconclusive check-back."""

    from outbox import store

    settings = _db_settings(database_url, schema)
    with database(settings) as conn:
        rows = store.discarded(conn, settings.schema_name, limit)
    if not rows:
        click.echo("no discarded messages", err=True)
        return
    for row in rows:
        key = "-" if row.key is None else row.key.decode(errors="replace")
        when = f"{row.discarded_at:%Y-%m-%d %H:%M:%S%z}" if row.discarded_at else "?"
        click.echo(f"{row.id}\tgroup={row.producer_group}\ttopic={row.topic}\tkey={key}\t"
                   f"discarded {when}\t{row.detail or ''}")
    click.echo(f"{len(rows)} discarded; `outbox resume ID ...` checks them again", err=True)


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
        if not limit or not (limit.isdigit() or limit == "none"):
            raise click.BadParameter(f"{value!r}: use FINDING=N or FINDING=none")
        parsed[name.strip()] = None if limit == "none" else int(limit)
    return parsed


@main.command()
@settings_options
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
              help="parallel JDBC reads per table [env OUTBOX_RECONCILE_PARTITIONS; 8]")
@click.option("--master", help="Spark master [env OUTBOX_RECONCILE_SPARK_MASTER; "
              "spark-submit's, else local[*]]")
@click.option("--log-level", help="DEBUG, INFO, WARNING [env OUTBOX_LOG_LEVEL]")
@friendly_errors
def reconcile(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
              since: datetime | None, until: datetime | None, read_topics: bool | None,
              output_dir: str | None, sla_seconds: float | None,
              thresholds: dict[str, int | None], partitions: int | None, master: str | None,
              log_level: str | None) -> None:
    """Prove every committed message reached Kafka exactly where its op record says.

    Runs a Spark job over the messages created since the last run (or --since/--until),
    prints a short report and writes Parquet details under --output-dir. Exit code 0: no
    finding over its threshold; 1: at least one is; 2: a usage or configuration error.
    """
    try:
        from spark import reconcile as job
    except ImportError as exc:
        raise ConfigurationError(
            f"reconcile needs the spark extra ({exc}): pip install "
            "'transactional-outbox[spark]'") from None

    settings = load_settings(
        database_url=database_url, kafka_bootstrap=kafka_bootstrap, schema=schema,
        reconcile_read_topics=read_topics, reconcile_output_dir=output_dir,
        reconcile_sla_seconds=sla_seconds, reconcile_partitions=partitions,
        reconcile_spark_master=master, log_level=log_level,
    )
    settings.require("database_url")
    settings = settings.model_copy(update={
        "reconcile_thresholds": {**settings.reconcile_thresholds, **thresholds}})
    setup_logging(settings.log_level)
    with job.session(settings) as spark:
        result = job.run(spark, settings, since=since, until=until)
    click.echo(result.report, nl=False)
    sys.exit(result.exit_code)
