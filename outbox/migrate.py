"""Applying the outbox's Alembic revisions to a schema (``outbox db upgrade`` and friends).

Our revisions carry the branch label ``outbox`` and record their version in
``<schema>.outbox_alembic_version``, so an application's own Alembic history never clashes.

Alembic is imported only by what runs it (upgrade, downgrade, current): importing it cost
every process about 0.35 s of its 1.4 s start (``outbox status``, each relay and sweeper,
whose :func:`require_current` needs only the revisions' ids, read from the scripts' names).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from outbox import migrations, store
from outbox.exceptions import (
    LOCK_NOT_AVAILABLE,
    ConfigurationError,
    MigrationBlocked,
    MigrationRefused,
    SchemaNotMigrated,
    db_command,
    first_line,
    read_only,
    sqlstate,
)
from outbox.schema import VERSION_TABLE
from outbox.settings import PARTITION_SIZE, sqlalchemy_url, validate_identifier

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

log = logging.getLogger("outbox.migrate")
#: How long a migration's statement waits for a table's lock; while it waits, every reader
#: and writer of that table (publishers, the relay) queues behind it.
LOCK_TIMEOUT = "2s"
#: How long :func:`upgrade` and :func:`downgrade` keep trying when locks are not to be had.
LOCK_PATIENCE_SECONDS = 300.0
FIRST_RETRY_SECONDS = 1.0
LAST_RETRY_SECONDS = 30.0


@cache
def _script_location() -> Path:
    """The folder of our Alembic scripts. Alembic reads only folders: when the package runs
    from a zip or wheel (``spark-submit --py-files``), its scripts are copied out first."""
    scripts = resources.files(migrations)
    if isinstance(scripts, Path):
        return scripts
    folder = Path(tempfile.mkdtemp(prefix="outbox-migrations-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _copy(scripts, folder)
    return folder


def _copy(source: Traversable, target: Path) -> None:
    for entry in source.iterdir():
        if entry.is_dir():
            (target / entry.name).mkdir()
            _copy(entry, target / entry.name)
        else:
            (target / entry.name).write_bytes(entry.read_bytes())


def alembic_config(url: str, schema: str, connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_script_location()))
    config.attributes["schema"] = validate_identifier(schema)
    config.attributes["url"] = sqlalchemy_url(url)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@contextlib.contextmanager
def _keeping_callers_alembic() -> Iterator[None]:
    """Alembic keeps one global ``context`` and ``op``; running ours from an application's
    env.py would leave that run without them (``KeyError: 'config'``), so put them back;
    Alembic's refusals become :class:`MigrationRefused`."""
    from alembic import context, op
    from alembic.util.exc import CommandError

    outer = [proxy for proxy in (getattr(context, "_proxy", None), getattr(op, "_proxy", None))
             if proxy is not None]
    try:
        yield
    except CommandError as exc:
        raise MigrationRefused(first_line(exc)) from None
    finally:
        for proxy in outer:
            proxy._install_proxy()


def upgrade(url: str, schema: str, revision: str = "head",
            partition_size: int = PARTITION_SIZE) -> None:
    """Also safe to call from an application's own Alembic env.py. At head, also creates the
    partitions the next message ids need (the relay's retention keeps doing so)."""
    from alembic import command

    _require_revision(revision)

    def migrating(conn: Connection) -> None:
        _refuse_newer(schema, store.schema_version(conn, schema))
        _refuse_older(schema, store.schema_version(conn, schema), revision)
        config = alembic_config(url, schema, conn)
        config.attributes["partition_size"] = partition_size
        command.upgrade(config, revision)
        if store.schema_version(conn, schema) == head():
            store.ensure_partitions(conn, schema, partition_size)

    _patiently(url, schema, migrating)


def downgrade(url: str, schema: str, revision: str) -> None:
    from alembic import command

    _require_revision(revision)
    _patiently(url, schema, lambda conn: command.downgrade(
        alembic_config(url, schema, conn), revision))


def _require_revision(revision: str) -> None:
    """An empty revision failed deep in Alembic, with a traceback (an AssertionError)."""
    if not isinstance(revision, str) or not revision.strip():
        raise ConfigurationError(f"revision {revision!r} names none: give a revision id such "
                                 "as 0003, 'head' or 'base'")


IncludeName = Callable[[str | None, str, MutableMapping[str, str | None]], bool]


def ignore_outbox(schema: str = "outbox", include_name: IncludeName | None = None
                  ) -> IncludeName:
    """An ``include_name`` for an application's Alembic env.py: autogenerate never proposes
    to drop (or alter) the outbox's schema and tables. Chains to your own ``include_name``."""
    schema = validate_identifier(schema)

    def include(name: str | None, type_: str, parent_names: MutableMapping[str, str | None]
                ) -> bool:
        if (type_ == "schema" and name == schema) or name == VERSION_TABLE or (
                type_ == "table" and parent_names.get("schema_name") == schema):
            return False
        return include_name(name, type_, parent_names) if include_name else True

    return include


def create_roles(url: str, schema: str) -> list[str]:
    """Create (if absent) and grant the least-privilege roles; returns their names."""
    def creating(conn: Connection) -> None:
        for block in ("create_roles", "create_reconcile_role", "create_checker_role"):
            conn.exec_driver_sql(str(store.query(block, schema)))

    _patiently(url, schema, creating)
    return [f"{schema}_{kind}"
            for kind in ("app", "relay", "sweeper", "reconcile", "checker", "console")]


def missing_grants(url: str, schema: str) -> list[str]:
    """What :func:`create_roles` could not grant (it takes a superuser), as statements for
    one to run: PostgreSQL's own warning of it reaches no one through the driver."""
    with _connected(url) as conn:
        sees = conn.execute(store.query("reconcile_role_sees_activity", schema)).scalar()
    return [] if sees else [f"GRANT pg_read_all_stats TO {schema}_reconcile"]


@contextlib.contextmanager
def _connected(url: str) -> Iterator[Connection]:
    """A connection of an engine of its own, disposed of afterwards (a command's one look)."""
    engine = store.engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


@contextlib.contextmanager
def _serialised(url: str, schema: str) -> Iterator[Connection]:
    """One transaction holding the schema's migration lock: two ``db upgrade`` runs at once
    take turns (the second finds the work done) instead of racing to create the same tables."""
    with _connected(url) as conn, conn.begin():
        store.lock_migrations(conn, validate_identifier(schema), LOCK_TIMEOUT)
        yield conn


def _patiently(url: str, schema: str, migrating: Callable[[Connection], None]) -> None:
    """Run ``migrating`` in a :func:`_serialised` transaction; when a statement's wait for a
    lock times out (a long transaction holds one of the tables), roll back, say who holds
    it, and try again with back-off, for ``LOCK_PATIENCE_SECONDS`` at most."""
    deadline = time.monotonic() + LOCK_PATIENCE_SECONDS
    pause = FIRST_RETRY_SECONDS
    while True:
        try:
            with _keeping_callers_alembic(), _serialised(url, schema) as conn:
                migrating(conn)
            return
        except DBAPIError as exc:
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            holders = _lock_holders(url, schema)
            if time.monotonic() + pause > deadline:
                raise MigrationBlocked(
                    f"migrating schema {schema} gave up after {LOCK_PATIENCE_SECONDS:.0f}s of "
                    f"waiting for its tables' locks, held by {holders}: end that transaction, "
                    "then run it again") from None
            log.warning("migrating schema %s: a lock it needs is held by %s; rolled back (its "
                        "wait would queue every reader of the table), trying again in %.0fs",
                        schema, holders, pause)
            time.sleep(pause)
            pause = min(pause * 2, LAST_RETRY_SECONDS)


def _lock_holders(url: str, schema: str) -> str:
    with _connected(url) as conn:
        return store.lock_holders(conn, schema)


@cache
def scripts() -> ScriptDirectory:
    """Alembic's view of our scripts."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("postgresql://localhost/unused", "outbox"))


@cache
def revisions() -> tuple[str, ...]:
    """Our revisions' ids, oldest first, from the scripts' names (``0024_what_it_does.py``
    holds revision ``0024``, whose down revision is the one before it:
    tests/unit/test_imports.py holds them to :func:`scripts`)."""
    versions = resources.files(migrations).joinpath("versions")
    return tuple(sorted(entry.name.partition("_")[0] for entry in versions.iterdir()
                        if entry.name.endswith(".py") and entry.name[:1].isdigit()))


def head() -> str:
    return revisions()[-1]


def _refuse_newer(schema: str, version: str | None) -> None:
    """A schema a newer outbox upgraded: ``outbox db upgrade`` of this one cannot help."""
    if version is not None and version not in revisions():
        raise SchemaNotMigrated(
            f"outbox schema {schema!r} is at revision {version}, newer than this outbox "
            f"(its newest is {head()}): run the outbox version that upgraded it, or downgrade "
            "the schema with that version first")


def _refuse_older(schema: str, version: str | None, revision: str) -> None:
    """An upgrade to a revision the schema is past did nothing and exited 0."""
    ours = revisions()
    if version in ours and revision in ours and ours.index(revision) < ours.index(version):
        raise MigrationRefused(
            f"schema {schema!r} is at revision {version}, past {revision}: an upgrade does not "
            f"go back; `{db_command(schema, f'downgrade {revision}')}` does")


def current(url: str, schema: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with _connected(url) as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
        )
        return context.get_current_revision()


def require_writable(conn: Connection, schema: str, url: str) -> None:
    """A relay or sweeper on a read-only server (a standby, a role's
    default_transaction_read_only) ran for good, delivering nothing, and said only once
    that it could not renew its leases. ``url``: masked, for the line."""
    if conn.execute(store.query("read_only", schema)).scalar_one():
        raise ConfigurationError(read_only(url))


def require_current(conn: Connection, schema: str) -> None:
    """Fail with a clear line when the schema is missing or behind the code."""
    version = store.schema_version(conn, schema)
    _refuse_newer(schema, version)
    if version != head():
        state = "not migrated" if version is None else f"at revision {version}, not {head()}"
        raise SchemaNotMigrated(
            f"outbox schema {schema!r} is {state}: run `{db_command(schema)}` first"
        )
