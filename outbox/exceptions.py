"""The errors the outbox raises. Each message is one line that says what to fix."""

import re


class OutboxError(Exception):
    """Base class for every error raised by the outbox."""


class InvalidMessage(OutboxError, ValueError):
    """A message cannot be published as given (topic, key, headers or payload)."""


class NotInTransaction(OutboxError):
    """``publish``, ``prepare``, or a decision given a session or connection with no open
    transaction (autocommit included), or ``publish``/``prepare`` given an Engine."""


class NotAwaited(OutboxError, RuntimeError):
    """A transaction holding an async ``publish``, ``prepare`` or decision that was never
    awaited is committed: refused, since the message was never written."""


class ConfigurationError(OutboxError):
    """A setting is missing or invalid."""


class CheckerRefused(ConfigurationError):
    """PostgreSQL refuses a SQL checker: not one statement, unparsable, or no answer column."""


class SchemaNotMigrated(OutboxError):
    """The schema is missing, or not at the revision this code expects (older: run the
    upgrade; newer: run newer code)."""


class MigrationBlocked(OutboxError):
    """A migration could not get its tables' locks: a long transaction holds one."""


class MigrationRefused(OutboxError):
    """Alembic refused a migration (a revision it does not know, say); its first line."""


class ServiceUnavailable(OutboxError):
    """Kafka (or a service of ``outbox dev``) cannot be reached at the configured address;
    an unreachable PostgreSQL surfaces as SQLAlchemy's ``OperationalError``."""


class MessageNotFound(OutboxError, LookupError):
    """A decision names a message id that has no prepare row in this schema."""


class DecisionConflict(OutboxError):
    """A message already resolved one way was asked to be resolved the other way."""


def first_line(exc: BaseException | None) -> str:
    """The first line of an error (a driver's own message when wrapped), for one-line logs."""
    if exc is None:
        return "unknown error"
    text = _text(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _text(exc: BaseException) -> str:
    """An error's text (a driver's own when wrapped). A checker's error whose ``__str__``
    raised, reported here, raised again where it was being counted: it never was."""
    try:
        return str(getattr(exc, "orig", None) or exc).strip()
    except Exception as unreadable:  # any: the code that raised it is the error's own
        return f"(its text is unreadable: str() raised {type(unreadable).__name__})"


def describe(exc: BaseException | None) -> str:
    """``Type: first line``: what a parked message's reason or an outage line says."""
    if exc is None:
        return "unknown error"
    text = _text(exc)
    name = type(exc).__name__
    # kafka-python's errors name themselves (after their code, for a broker's answer)
    text = re.sub(rf"^(\[Error -?\d+\] )?{name}: ", r"\1", text)
    return f"{name}: {text.splitlines()[0] if text else ''}".rstrip(": ")


#: PostgreSQL's SQLSTATEs for a missing table, schema or function: what is missing, and what
#: that says of an outbox schema (it is older than the code, or was never migrated).
MISSING_OBJECTS = {"42P01": ("a table is missing", "has no outbox tables"),
                   "3F000": ("the schema is missing", "does not exist"),
                   "42883": ("a function is missing", "is older than this version of outbox")}

#: A role lacks a privilege for the statement.
INSUFFICIENT_PRIVILEGE = "42501"
#: SQLSTATEs that no retry can fix: the role lacks a privilege, or an object is missing.
_SETUP_SQLSTATES = {INSUFFICIENT_PRIVILEGE: "the database role lacks a privilege",
                    **{state: missing for state, (missing, _) in MISSING_OBJECTS.items()}}


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE under SQLAlchemy's or Django's wrapper: psycopg and asyncpg call it
    ``sqlstate``, psycopg2 ``pgcode``."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        code = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        if code:
            return str(code)
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


#: A statement gave up waiting for a lock (``lock_timeout``).
LOCK_NOT_AVAILABLE = "55P03"
#: How long a short command (status, resume, discarded, prune) and the relay's retention pass
#: wait for a lock on the outbox's tables, held by an upgrade or an operator's LOCK TABLE,
#: ALTER or DETACH PARTITION, before they say who holds it.
LOCK_WAIT_SECONDS = 5
#: A write in a read-only transaction (or on a standby).
READ_ONLY_TRANSACTION = "25006"
#: SQLSTATEs (and classes) of a server that cannot run any statement now: connection
#: trouble, insufficient resources, a shutdown, a conflict with another session, a system
#: error (I/O), a standby refusing a write (a failover's old primary).
_OUTAGE_SQLSTATES = ("08", "53", "57P", "40", "58", LOCK_NOT_AVAILABLE, READ_ONLY_TRANSACTION)


def server_trouble(exc: BaseException) -> bool:
    """Whether a database error says nothing of the statement: the server could not run any
    statement now. A lost connection carries no SQLSTATE and counts too. (A privilege or
    object missing is the statement's own: a SQL checker may try what its role may not.)"""
    state = sqlstate(exc)
    if state is None:
        return type(getattr(exc, "orig", None) or exc).__name__ in (
            "OperationalError", "InterfaceError")
    return state.startswith(_OUTAGE_SQLSTATES)


def read_only(url: str) -> str:
    """The line for a server that refuses writes; ``url`` masked."""
    return (f"PostgreSQL at {url} refuses writes: it is read-only (a standby, or "
            "default_transaction_read_only on the database or role): point the URL at the "
            "primary (?target_session_attrs=read-write)")


def db_command(schema: str, action: str = "upgrade") -> str:
    """The command that migrates ``schema`` (``action``: another ``db`` command and its
    arguments), as a user types it."""
    return f"outbox db {action}" if schema == "outbox" else f"outbox --schema {schema} db {action}"


def setup_error(exc: BaseException, schema: str = "outbox") -> str | None:
    """One line for a database error that is a setup mistake, not an outage; else None.
    ``schema``: the one the failed command used, which the line's command migrates."""
    what = _SETUP_SQLSTATES.get(sqlstate(exc) or "")
    if what is None:
        return None
    return (f"{what} ({first_line(exc)}): run `{db_command(schema)}` (with "
            "--create-roles for the roles) and grant this login the role it needs "
            "(docs/operations.md)")


def lock_wait_exceeded(schema: str, holders: str) -> str:
    """What a statement that gave up after :data:`LOCK_WAIT_SECONDS` says (``holders``:
    ``store.lock_holders``)."""
    return (f"waited up to {LOCK_WAIT_SECONDS}s for a lock on schema {schema}'s tables, "
            f"held by {holders}")
