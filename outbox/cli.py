"""The ``outbox`` command line: database migrations, the relay, and the embedded services."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click
from sqlalchemy.exc import OperationalError

from outbox.exceptions import OutboxError
from outbox.settings import Settings, load_settings, mask_url

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
def main() -> None:
    """Transactional outbox on PostgreSQL, relayed to Kafka."""


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
@friendly_errors
def upgrade(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
            revision: str) -> None:
    """Create or upgrade the outbox tables."""
    _migrate("upgrade", database_url, schema, revision)


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
@click.option("--log-level", help="DEBUG, INFO, WARNING [env OUTBOX_LOG_LEVEL]")
@friendly_errors
def relay(database_url: str | None, kafka_bootstrap: str | None, schema: str | None,
          batch_size: int | None, poll_interval: float | None, lease_seconds: float | None,
          log_level: str | None) -> None:
    """Deliver committed messages to Kafka until SIGTERM or Ctrl-C."""
    from relay.relay import Relay

    settings = load_settings(
        database_url=database_url, kafka_bootstrap=kafka_bootstrap, schema=schema,
        relay_batch_size=batch_size, relay_poll_interval=poll_interval,
        relay_lease_seconds=lease_seconds, log_level=log_level,
    )
    setup_logging(settings.log_level)
    daemon = Relay(settings)

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
    from sqlalchemy import create_engine

    from outbox import store

    if not ids and not resume_all:
        raise click.UsageError("give message ids, or --all")
    settings = _db_settings(database_url, schema)
    engine = create_engine(settings.sqlalchemy_url)
    try:
        with engine.begin() as conn:
            resumed = store.resume(conn, settings.schema_name, f"cli:{settings.worker_id}",
                                   ids, resume_all=resume_all)
    finally:
        engine.dispose()
    for message_id, was in resumed:
        click.echo(f"resumed message {message_id} (was {was})")
    missing = set(ids) - {message_id for message_id, _ in resumed}
    if missing:
        click.echo(f"not resumed (unknown, or neither PARKED nor DISCARDED): "
                   f"{', '.join(map(str, sorted(missing)))}", err=True)
        sys.exit(1)
    if not resumed:
        click.echo("nothing to resume", err=True)
