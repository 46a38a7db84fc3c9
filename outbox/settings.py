"""The one settings model: flags > ``OUTBOX_*`` environment variables > defaults."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from outbox.exceptions import ConfigurationError

IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def validate_identifier(value: str, what: str = "schema") -> str:
    """Reject SQL identifiers that would need quoting, so none is ever interpolated raw."""
    if not IDENTIFIER.match(value):
        raise ConfigurationError(
            f"invalid {what} name {value!r}: use lower-case letters, digits and '_' "
            "(at most 63 characters, not starting with a digit)"
        )
    return value


def sqlalchemy_url(url: str) -> str:
    """Accept ``postgresql://`` URLs and pin the psycopg 3 driver."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigurationError(f"invalid database URL {mask_url(url)!r}: {exc}") from None
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(
            f"database URL must be postgresql://..., got {parsed.get_backend_name()!r}"
        )
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``, for logs and errors."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Settings(BaseSettings):
    """Settings shared by the library, the relay and the CLI."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="forbid", populate_by_name=True)

    database_url: str = Field(
        default="", description="PostgreSQL URL, e.g. postgresql://user:pass@host:5432/db"
    )
    kafka_bootstrap: str = Field(default="", description="Kafka bootstrap servers, host:port,...")
    schema_name: str = Field(
        default="outbox",
        description="PostgreSQL schema holding the outbox tables",
        validation_alias="OUTBOX_SCHEMA",
    )
    max_payload_bytes: int = Field(default=1024 * 1024, gt=0)
    relay_batch_size: int = Field(default=500, gt=0, le=100_000)
    relay_poll_interval: float = Field(
        default=1.0, gt=0, description="seconds between polls when no NOTIFY arrives"
    )
    relay_lease_seconds: float = Field(
        default=10.0, gt=0, description="a dead relay's shards are taken over after this"
    )
    worker_id: str = Field(default_factory=default_worker_id)
    log_level: str = "INFO"

    @field_validator("schema_name")
    @classmethod
    def _schema(cls, value: str) -> str:
        try:
            return validate_identifier(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    def require(self, *names: str) -> None:
        """Fail with one clear line when a setting a command needs is empty."""
        for name in names:
            if not getattr(self, name):
                raise ConfigurationError(
                    f"{name} is not set: pass --{name.replace('_', '-')} or set "
                    f"OUTBOX_{name.upper()}"
                )

    @property
    def sqlalchemy_url(self) -> str:
        self.require("database_url")
        return sqlalchemy_url(self.database_url)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings, turning validation errors into one line per bad field."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "schema" in given:
        given["schema_name"] = given.pop("schema")
    try:
        return Settings(**given)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        ]
        raise ConfigurationError("invalid settings: " + "; ".join(lines)) from None
