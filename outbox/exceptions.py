"""The errors the outbox raises. Each message is one line that says what to fix."""


class OutboxError(Exception):
    """Base class for every error raised by the outbox."""


class InvalidMessage(OutboxError, ValueError):
    """A message cannot be published as given (topic, key, headers or payload)."""


class NotInTransaction(OutboxError):
    """``publish`` was called on a session or connection with no open transaction."""


class ConfigurationError(OutboxError):
    """A setting is missing or invalid."""


class SchemaNotMigrated(OutboxError):
    """The outbox tables are missing: ``outbox db upgrade`` has not been run."""


class ServiceUnavailable(OutboxError):
    """PostgreSQL or Kafka cannot be reached with the configured address."""


class MessageNotFound(OutboxError, LookupError):
    """A decision names a message id that has no prepare row in this schema."""


class DecisionConflict(OutboxError):
    """A message already resolved one way was asked to be resolved the other way."""


def first_line(exc: BaseException | None) -> str:
    """The first line of an error (a driver's own message when wrapped), for one-line logs."""
    if exc is None:
        return "unknown error"
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: BaseException | None) -> str:
    """``Type: first line``: what a parked message's reason or an outage line says."""
    if exc is None:
        return "unknown error"
    text = str(getattr(exc, "orig", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
