"""Settings per component, read one way: flags > ``OUTBOX_*`` environment variables > a TOML
config file (``--config`` or ``OUTBOX_CONFIG``) > defaults.

Each part takes only what it uses: ``Outbox`` a :class:`PublishSettings`, the relay a
:class:`RelaySettings`, the sweeper a :class:`SweepSettings`, reconciliation a
:class:`ReconcileSettings`, ``outbox prune`` a :class:`PruneSettings`, ``outbox db`` a
:class:`MigrateSettings`. :class:`Settings` is all of them at once (``outbox config``, and a
convenient value to pass anywhere). Field and variable names are flat (``relay_batch_size`` is
``OUTBOX_RELAY_BATCH_SIZE``) and the same in every class."""

from __future__ import annotations

import difflib
import json
import os
import re
import secrets
import socket
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, get_args

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo, timeout_from_conninfo
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)
from sqlalchemy.engine import make_url

from outbox.encoding import DEFAULT_MAX_DELAY, ascii_digits
from outbox.exceptions import ConfigurationError, ServiceUnavailable, first_line

#: Environment variable naming the TOML config file (also set by ``outbox --config``).
CONFIG_ENV = "OUTBOX_CONFIG"
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
#: The largest value an ``integer`` argument or a librdkafka property takes.
INT32_MAX = 2**31 - 1
#: PostgreSQL truncates names at 63 bytes; the longest role suffix is ``_reconcile``.
MAX_SCHEMA_LENGTH = 63 - len("_reconcile")

#: PostgreSQL's reserved key words (``pg_get_keywords()``, categories R and T, version 15):
#: a schema named one of these cannot be written without quotes.
RESERVED_WORDS = frozenset({
    "all", "analyse", "analyze", "and", "any", "array", "as", "asc", "asymmetric",
    "authorization", "binary", "both", "case", "cast", "check", "collate", "collation",
    "column", "concurrently", "constraint", "create", "cross", "current_catalog",
    "current_date", "current_role", "current_schema", "current_time", "current_timestamp",
    "current_user", "default", "deferrable", "desc", "distinct", "do", "else", "end",
    "except", "false", "fetch", "for", "foreign", "freeze", "from", "full", "grant",
    "group", "having", "ilike", "in", "initially", "inner", "intersect", "into", "is",
    "isnull", "join", "lateral", "leading", "left", "like", "limit", "localtime",
    "localtimestamp", "natural", "not", "notnull", "null", "offset", "on", "only", "or",
    "order", "outer", "overlaps", "placing", "primary", "references", "returning", "right",
    "select", "session_user", "similar", "some", "symmetric", "table", "tablesample",
    "then", "to", "trailing", "true", "union", "unique", "user", "using", "variadic",
    "verbose", "when", "where", "window", "with",
})


def validate_identifier(value: str, what: str = "schema") -> str:
    """Reject names that would need quoting, that PostgreSQL reserves, or whose derived role
    and channel names it would truncate; so none is ever interpolated raw or mangled."""
    if (not isinstance(value, str) or not IDENTIFIER.fullmatch(value)
            or len(value) > MAX_SCHEMA_LENGTH):
        raise ConfigurationError(
            f"invalid {what} name {value!r}: use lower-case letters, digits and '_' "
            f"(at most {MAX_SCHEMA_LENGTH} characters, not starting with a digit)"
        )
    if value.startswith("pg_") or value == "information_schema" or value in RESERVED_WORDS:
        raise ConfigurationError(
            f"invalid {what} name {value!r}: PostgreSQL reserves it; choose another name")
    if value == "public" and what == "schema":
        raise ConfigurationError(
            "invalid schema name 'public': the outbox's roles are granted on their whole "
            "schema (the reconciliation role would read every table in it); choose a schema "
            "of the outbox's own")
    return value


#: Connection parameters that are secrets (libpq's names, also as URL query parameters).
_SECRET_KEYS = frozenset({"password", "sslpassword"})


def tcp_timeouts(seconds: float) -> dict[str, str]:
    """libpq's parameters that end a connection to a database gone silent within about
    ``seconds``: unacknowledged data (``tcp_user_timeout``), an idle connection's keepalive
    probes unanswered (idle half of it, then 3 probes), a connection attempt
    (``connect_timeout``). Without them a connection whose peer vanished without a reset (a
    dropped NAT entry, a host powered off) blocks until the kernel gives up: about 15
    minutes with data in flight, for ever when idle."""
    whole = max(2, round(seconds))
    return {"connect_timeout": str(whole), "keepalives": "1",
            "keepalives_idle": str(max(1, whole // 2)),
            "keepalives_interval": str(max(1, whole // 6)), "keepalives_count": "3",
            "tcp_user_timeout": str(round(seconds * 1000))}


def sqlalchemy_url(url: str, tcp_timeout: float | None = None) -> str:
    """Accept ``postgresql://`` URLs (and ``postgres://``, as libpq does and hosting
    platforms hand out) and pin the psycopg 3 driver; with ``tcp_timeout``, add
    :func:`tcp_timeouts`'s parameters that the URL does not set itself."""
    try:
        parsed = make_url(url)
    except Exception:  # its message would echo the whole string, password included
        raise ConfigurationError(
            f"invalid database URL {mask_url(url)!r}: use postgresql://user:password@host:port/db"
        ) from None
    if parsed.host and "@" in parsed.host:
        raise ConfigurationError(
            f"invalid database URL {mask_url(url)!r}: write an '@' in the password as %40")
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ConfigurationError(
            f"database URL must be postgresql://..., got {parsed.get_backend_name()!r}"
        )
    _check_parameters(url, parsed.query)
    if tcp_timeout is not None:
        parsed = parsed.update_query_dict({name: value for name, value
                                           in tcp_timeouts(tcp_timeout).items()
                                           if name not in parsed.query})
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def _check_parameters(url: str, query: Mapping[str, str | tuple[str, ...]]) -> None:
    """Refuse what psycopg refuses before it connects (a misspelt option, a connect_timeout
    that is no number): it raises no outage's error, and every command printed a traceback."""
    params = {name: ",".join(value) if isinstance(value, tuple) else value
              for name, value in query.items()}
    try:
        timeout_from_conninfo(conninfo_to_dict(make_conninfo("", **params)))
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid database URL {mask_url(url)!r}: {exc}") from None


def mask_url(url: str) -> str:
    """The database URL (or libpq ``key=value`` string) with every password replaced by
    ``***``, for logs and errors; parsed with SQLAlchemy's and libpq's own parsers."""
    if "://" not in url:
        try:
            params = conninfo_to_dict(url)
        except Exception:  # show it only if it cannot hold a secret
            return url if "=" not in url and "@" not in url else "(an unparseable string)"
        return " ".join(f"{key}={'***' if key in _SECRET_KEYS else value}"
                        for key, value in params.items())
    try:
        parsed = make_url(url)
    except Exception:
        return "(an unparseable URL)"
    if parsed.host and "@" in parsed.host:  # an unencoded '@' in the password
        parsed = parsed.set(password="***", host=parsed.host.rpartition("@")[2])
    elif parsed.password is not None:
        parsed = parsed.set(password="***")
    query = {key: "***" if key.lower() in _SECRET_KEYS else value
             for key, value in parsed.query.items()}
    return (parsed.set(query=query).render_as_string(hide_password=False)
            .replace("%2A%2A%2A", "***"))


def default_worker_id() -> str:
    """``host:pid:random``: unique per process even where containers repeat both."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class _Base(BaseSettings):
    """The sources and helpers every component's settings share."""

    # No inf or NaN: an infinite lease or timeout silently disables what it bounds. Errors
    # do not echo their input: a model-wide check's is every setting, the database URL too.
    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="forbid", populate_by_name=True,
                                      allow_inf_nan=False, hide_input_in_errors=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init) > environment > the config file named by OUTBOX_CONFIG > defaults."""
        _one_variable_per_setting(os.environ)
        sources: list[PydanticBaseSettingsSource] = [init_settings, _Environment(settings_cls)]
        config_file = os.environ.get(CONFIG_ENV)
        if config_file:
            if not Path(config_file).is_file():
                raise ConfigurationError(
                    f"config file {config_file!r} (from --config or {CONFIG_ENV}) not found")
            try:
                sources.append(_ConfigFile(settings_cls, toml_file=config_file))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigurationError(
                    f"config file {config_file} is not valid TOML: {exc}") from None
            except OSError as exc:  # unreadable: permissions, a mount gone
                raise ConfigurationError(
                    f"config file {config_file} cannot be read: {exc.strerror or exc}"
                ) from None
        return tuple(sources)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """A TOML ``true`` or ``false`` given for a number was read as 1 or 0
        (``relay_metrics_port = true`` served the metrics on port 1)."""
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, bool) and {int, float} & {annotation, *get_args(annotation)}:
            raise ValueError(f"{str(value).lower()} given: it is a number, not true or false")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _unset_if_empty(cls, value: object, info: ValidationInfo) -> object:
        """An empty variable (``OUTBOX_TOPIC_HOLD_PARK_AFTER=``, as Compose passes
        ``${PARK_AFTER:-}``) of a setting that may be unset is unset: a number's stopped the
        relay without showing the empty value; a TLS file's passed the security check as
        unset, then the clients looked for a file named ''."""
        if isinstance(value, str) and not value.strip() and info.field_name \
                and cls.model_fields[info.field_name].default is None:
            return None
        return value

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """What ``repr()`` and ``str()`` show (an error tracker's captured locals, a logged
        settings object): the database URL masked, as ``SecretStr`` masks the others."""
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "database_url" else value

    def masked(self) -> dict[str, Any]:
        """Every setting, with passwords replaced by ``***``: safe to print or log."""
        values = self.model_dump()
        if "database_url" in values:
            values["database_url"] = mask_url(values["database_url"])
        for name, value in values.items():
            if isinstance(value, SecretStr):
                values[name] = "***" if value.get_secret_value() else ""
        return values

    def require(self, *names: str) -> None:
        """Fail with one clear line when a setting a command needs is empty."""
        for name in names:
            if not getattr(self, name):
                raise ConfigurationError(
                    f"{name} is not set: pass --{name.replace('_', '-')} or set "
                    f"OUTBOX_{name.upper()}"
                )


def _one_variable_per_setting(environ: Mapping[str, str]) -> None:
    """Variables are read in any case (``outbox_schema`` is ``OUTBOX_SCHEMA``), and the schema
    under two names (``OUTBOX_SCHEMA_NAME``, from the field's name, too). Two that set one
    setting to different values are refused: whichever came later in the environment
    silently won. Secrets are not echoed."""
    variables = _variables()
    first: dict[str, tuple[str, str]] = {}
    for name, value in sorted(environ.items()):  # OUTBOX_X before outbox_x
        field = variables.get(name.upper())
        if field is None:
            continue
        seen, seen_value = first.setdefault(field, (name, value))
        if seen_value != value:
            canonical = "OUTBOX_SCHEMA" if field == "schema_name" else f"OUTBOX_{field.upper()}"
            what = ("name different schemas" if field == "schema_name"
                    else f"set {field} to different values")
            raise ConfigurationError(
                f"{seen}={_shown(field, seen_value)!r} and {name}={_shown(field, value)!r} "
                f"{what}: set {canonical} only")


def _variables() -> dict[str, str]:
    """Each setting's variable names, in capitals (the schema's two), to its field's name."""
    names = {f"OUTBOX_{field.upper()}": field for field in Settings.model_fields}
    names["OUTBOX_SCHEMA"] = "schema_name"
    return names


def _shown(field: str, value: str) -> str:
    """A variable's value as an error may print it: a password masked."""
    if field == "database_url":
        return mask_url(value)
    return "***" if "SecretStr" in str(Settings.model_fields[field].annotation) else value


class _Environment(EnvSettingsSource):
    """The ``OUTBOX_*`` variables; a JSON object that gives a key twice is refused (the last
    silently won: a second checker of a group pasted below the first replaced it)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        return json.loads(value, object_pairs_hook=_unique_keys)


class _KeyTwice(ValueError):
    """A JSON object gave a key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _KeyTwice(f"gives the key {key!r} twice")
        found[key] = value
    return found


class _ConfigFile(TomlConfigSettingsSource):
    """The TOML file holds every component's keys: each takes its own; unknown keys fail,
    and so does a setting given twice (its key in two cases: pydantic kept one)."""

    def __call__(self) -> dict[str, Any]:
        # In any case, as the variables: pydantic folds only the keys of the class it loads.
        known = {name.lower(): name for name in _names(Settings)}
        first: dict[str, str] = {}
        for key in sorted(self.toml_data):
            seen = first.setdefault(known.get(key.lower(), key), key)
            if seen != key:
                raise ConfigurationError(
                    f"invalid settings: keys {seen!r} and {key!r} in config file "
                    f"{os.environ.get(CONFIG_ENV)} both set {known[key.lower()]}: keep one")
        values = {known.get(key.lower(), key): value for key, value in super().__call__().items()}
        unknown = sorted(set(values) - set(known.values()))
        if unknown:
            raise ConfigurationError(
                f"invalid settings: unknown key {unknown[0]!r} in config file "
                f"{os.environ.get(CONFIG_ENV)}: see docs/configuration.md for the names")
        mine = _names(self.settings_cls)
        return {name: value for name, value in values.items() if name in mine}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``OUTBOX_*`` variable no setting reads (a typo would be ignored)."""
    known = {CONFIG_ENV} | {name if name.startswith("OUTBOX_") else f"OUTBOX_{name.upper()}"
                            for name in _names(Settings)}
    lines = []
    for name in sorted(environ):  # in any case, as pydantic reads them (OUTBOX_CONFIG: not)
        if name.upper().startswith("OUTBOX_") and (name.upper() not in known
                                                   or name.upper() == CONFIG_ENV != name):
            close = difflib.get_close_matches(name.upper(), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"unknown setting {name} is ignored{hint}")
    return lines


def _names(cls: type[BaseSettings]) -> set[str]:
    """Field names and their aliases (the schema is ``schema_name`` or ``OUTBOX_SCHEMA``)."""
    names = set(cls.model_fields)
    for field in cls.model_fields.values():
        if isinstance(field.validation_alias, str):
            names.add(field.validation_alias)
    return names


class _Identity(_Base):
    """Where the outbox tables are, and who is speaking (every part, the library included)."""

    database_url: str = Field(
        default="", description="PostgreSQL URL, e.g. postgresql://user:pass@host:5432/db"
    )
    schema_name: str = Field(
        default="outbox",
        description="PostgreSQL schema holding the outbox tables",
        validation_alias="OUTBOX_SCHEMA",
    )
    worker_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=200)

    @field_validator("database_url", mode="before")
    @classmethod
    def _trimmed(cls, value: object) -> object:
        """A URL read from a secret file often ends in a newline: it would be part of the
        database's name."""
        return value.strip() if isinstance(value, str) else value

    @field_validator("schema_name")
    @classmethod
    def _schema(cls, value: str) -> str:
        try:
            return validate_identifier(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, value: str) -> str:
        """Printable ASCII: it names the relay's sessions (``application_name``), in which
        PostgreSQL replaces any other character, and a relay would not find its own lost
        session again (it took it for a twin's)."""
        if not re.fullmatch(r"[!-~]+", value):
            raise ValueError(f"{value!r} is not printable ASCII without spaces (it names the "
                             "daemon's sessions in PostgreSQL)")
        return value


class DatabaseSettings(_Identity):
    """The same, and how a process of the outbox's own connects and logs (every part but the
    library, which uses the application's connections and logging: a bad value of these
    must not stop an application that imports it)."""

    database_tcp_timeout: float = Field(
        default=30.0, ge=1, le=3600,
        description="seconds a connection to PostgreSQL may go silent (sent data "
        "unacknowledged, keepalive probes unanswered, a connection attempt) before it is "
        "dropped and made again; the URL's own libpq parameters win")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @property
    def sqlalchemy_url(self) -> str:
        self.require("database_url")
        return sqlalchemy_url(self.database_url, self.database_tcp_timeout)


class KafkaSettings(_Base):
    """How to reach Kafka: the relay's producer and reconciliation's reader share these."""

    kafka_bootstrap: str = Field(default="", description="Kafka bootstrap servers, host:port,...")
    kafka_client: Literal["kafka-python", "confluent"] = Field(
        default="kafka-python",
        description="the Kafka client of the relay and of reconciliation's topic reader: "
        "kafka-python, or confluent (librdkafka, faster; "
        "pip install 'transactional-outbox[confluent]')",
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = (
        "PLAINTEXT")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: str | None = Field(default=None, description="CA bundle to verify Kafka")
    kafka_ssl_certfile: str | None = Field(default=None, description="client certificate")
    kafka_ssl_keyfile: str | None = Field(default=None, description="client private key")
    kafka_delivery_timeout_ms: int = Field(
        default=120_000, ge=1000, le=INT32_MAX,
        description="how long the producer retries a send (at least 1 s)"
    )
    kafka_connect_timeout_ms: int = Field(
        default=15_000, ge=100, le=3_600_000,
        description="how long a relay or a reconciliation waits at start for a broker to answer"
    )
    kafka_max_request_size: int = Field(
        default=2 * 1024 * 1024, ge=1000, le=1_000_000_000,
        description="largest record the producer sends (librdkafka's range)"
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, value: str) -> str:
        """``host[:port],...`` (``[v6]:port`` for IPv6), checked now rather than by the Kafka
        client once the relay has started; spaces around entries dropped."""
        entries = [entry.strip() for entry in value.split(",")] if value.strip() else []
        for entry in entries:
            problem = _bootstrap_problem(entry)
            if problem:
                raise ValueError(f"{problem} in {value!r}: write host:port,host:port "
                                 "(an IPv6 address as [address]:port)")
        return ",".join(entries)

    @field_validator("kafka_sasl_username", "kafka_sasl_password", mode="before")
    @classmethod
    def _without_line_break(cls, value: object) -> object:
        """A login read from a secret file often ends in a newline (a Kubernetes secret made
        ``--from-file``): the broker refused it, and the relay said no broker answers.
        Spaces are kept: a password may end in one."""
        return value.rstrip("\r\n") if isinstance(value, str) else value

    @model_validator(mode="after")
    def _security(self) -> Self:
        """A SASL protocol needs its mechanism and login, and a login or TLS file set for a
        protocol that does not use it is a mistake (it would be ignored), and so is a client
        key without its certificate: all refused now, not after the relay's clients have
        waited for a broker that cannot let them in."""
        protocol = self.kafka_security_protocol
        login = {"kafka_sasl_mechanism": self.kafka_sasl_mechanism,
                 "kafka_sasl_username": self.kafka_sasl_username,
                 "kafka_sasl_password": self.kafka_sasl_password}
        files = {"kafka_ssl_cafile": self.kafka_ssl_cafile,
                 "kafka_ssl_certfile": self.kafka_ssl_certfile,
                 "kafka_ssl_keyfile": self.kafka_ssl_keyfile}
        if protocol.startswith("SASL"):
            missing = [name for name, value in login.items() if not value]
            if missing:
                raise ValueError(f"kafka_security_protocol {protocol} needs "
                                 f"{', '.join(missing)}")
        unused = [name for name, value in login.items() if value
                  and not protocol.startswith("SASL")]
        unused += [name for name, value in files.items() if value
                   and not protocol.endswith("SSL")]
        if unused:
            raise ValueError(f"{', '.join(unused)} set, but kafka_security_protocol "
                             f"{protocol} does not use it")
        if self.kafka_ssl_keyfile and not self.kafka_ssl_certfile:
            raise ValueError("kafka_ssl_keyfile set without kafka_ssl_certfile, the client "
                             "certificate it is the key of (kafka-python would connect "
                             "without either)")
        return self

    def kafka_security(self, client: Literal["kafka-python", "librdkafka"] = "kafka-python"
                       ) -> dict[str, Any]:
        """SASL/TLS settings in kafka-python's or librdkafka's names (unset ones left out)."""
        password = self.kafka_sasl_password
        values = {
            "kafka_security_protocol": self.kafka_security_protocol,
            "kafka_sasl_mechanism": self.kafka_sasl_mechanism,
            "kafka_sasl_username": self.kafka_sasl_username,
            "kafka_sasl_password": password.get_secret_value() if password else None,
            "kafka_ssl_cafile": self.kafka_ssl_cafile,
            "kafka_ssl_certfile": self.kafka_ssl_certfile,
            "kafka_ssl_keyfile": self.kafka_ssl_keyfile,
        }
        for name in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile"):
            path = values[name]
            if path is not None and not os.access(path, os.R_OK):
                raise ConfigurationError(  # the clients would wait, then blame the broker
                    f"{name} {path!r} (OUTBOX_{name.upper()}): "
                    f"{'no such file' if not os.path.exists(path) else 'cannot be read'}")
        names = _SECURITY_NAMES[client]
        return {names[field]: value for field, value in values.items() if value is not None}

    def kafka_python_connection(self) -> dict[str, Any]:
        """What a kafka-python client takes from the settings to reach the broker: SASL/TLS,
        and how long it waits at start for an answer (``bootstrap_timeout_ms``)."""
        return {**self.kafka_security(), "bootstrap_timeout_ms": self.kafka_connect_timeout_ms}

    def kafka_unreachable(self) -> ServiceUnavailable:
        """The one line for a relay or a reconciliation that no broker lets in. A refused login
        or a TLS mismatch looks like silence to the clients, so it names every setting that
        can cause it (the password only as ``***``)."""
        protocol = self.kafka_security_protocol
        check = ["OUTBOX_KAFKA_BOOTSTRAP", "OUTBOX_KAFKA_SECURITY_PROTOCOL"]
        login = ""
        if protocol.startswith("SASL"):
            login = f" as {self.kafka_sasl_username!r} ({self.kafka_sasl_mechanism})"
            check += ["OUTBOX_KAFKA_SASL_MECHANISM", "OUTBOX_KAFKA_SASL_USERNAME",
                      "OUTBOX_KAFKA_SASL_PASSWORD (***)"]
        if protocol.endswith("SSL"):
            check += [f"{name} ({value})" for name, value in (
                ("OUTBOX_KAFKA_SSL_CAFILE", self.kafka_ssl_cafile),
                ("OUTBOX_KAFKA_SSL_CERTFILE", self.kafka_ssl_certfile),
                ("OUTBOX_KAFKA_SSL_KEYFILE", self.kafka_ssl_keyfile)) if value]
        return ServiceUnavailable(
            f"no Kafka broker answers at {self.kafka_bootstrap} over {protocol}{login}: "
            f"is one running there? check {', '.join(check[:-1])} and {check[-1]}")


def split_host(entry: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port``): a bootstrap entry, or a URL's ``host`` parameter."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if ascii_digits(rest[1:]) else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, int(port) if ascii_digits(port) else None
    return entry, None  # a name, or an IPv6 address alone


def _bootstrap_problem(entry: str) -> str | None:
    """What is wrong with one ``host[:port]`` of a bootstrap list, or None."""
    _, separator, address = entry.partition("://")
    if separator:  # a broker's listener, as in its server.properties
        return (f"{entry!r} is a listener: write {address} (the protocol is "
                "OUTBOX_KAFKA_SECURITY_PROTOCOL)")
    if any(c.isspace() or c == ";" for c in entry):
        return f"{entry!r} holds a space or a semicolon (entries are separated by commas)"
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket:  # kafka-python's parser raised ValueError: a traceback
            return f"{entry!r} has no closing ']'"
        if rest and not rest.startswith(":"):
            return f"bad entry {entry!r}"
        port = rest[1:] if rest else None
    elif entry.count(":") > 1:
        return f"IPv6 address {entry!r} without brackets"
    else:
        host, colon, after = entry.partition(":")
        port = after if colon else None
    if not host:
        return "an empty host" if entry else "an empty entry"
    if port is not None and not (ascii_digits(port) and 0 < int(port) < 65536):
        return f"port {port!r} of {entry!r} is not a number from 1 to 65535"
    return None


#: Each security setting's name in the Kafka clients' own configurations.
_SECURITY_NAMES: dict[str, dict[str, str]] = {
    "kafka-python": {
        "kafka_security_protocol": "security_protocol",
        "kafka_sasl_mechanism": "sasl_mechanism",
        "kafka_sasl_username": "sasl_plain_username",
        "kafka_sasl_password": "sasl_plain_password",
        "kafka_ssl_cafile": "ssl_cafile",
        "kafka_ssl_certfile": "ssl_certfile",
        "kafka_ssl_keyfile": "ssl_keyfile",
    },
    "librdkafka": {
        "kafka_security_protocol": "security.protocol",
        "kafka_sasl_mechanism": "sasl.mechanisms",
        "kafka_sasl_username": "sasl.username",
        "kafka_sasl_password": "sasl.password",
        "kafka_ssl_cafile": "ssl.ca.location",
        "kafka_ssl_certfile": "ssl.certificate.location",
        "kafka_ssl_keyfile": "ssl.key.location",
    },
}


class PublishSettings(_Identity):
    """What ``Outbox`` (the library applications import) needs."""

    max_payload_bytes: int = Field(default=1024 * 1024, gt=0)
    notify: bool = Field(
        default=True,
        description="publish wakes the relays at commit with NOTIFY; off: relays poll",
    )
    transaction_timeout: float = Field(
        default=6.0, gt=0, le=86400,
        description="seconds before an UNKNOWN message is first checked back"
    )
    max_delay: float = Field(
        default=DEFAULT_MAX_DELAY, gt=0, le=3650 * 86400,
        description="longest deliver_after/deliver_at ahead, in seconds (a delayed message "
        "holds back its key until then)",
    )


#: Message ids per partition of ``message`` and ``op_record`` (revision 0006) by default.
PARTITION_SIZE = 1_000_000
#: Payload bytes one relay batch may hold by default.
RELAY_BATCH_BYTES = 16 * 1024 * 1024


class _Leases(_Base):
    """How long a relay's shards stay its own: the relay's, and ``outbox status``'s."""

    relay_lease_seconds: float = Field(
        default=10.0, ge=1, le=3600,
        description="a dead relay's shards are taken over after this (1 s to 1 h)"
    )


class _CheckTiming(_Base):
    """When a check-back is overdue: the sweeper's, and ``outbox status``'s."""

    checker_timeout: float = Field(
        default=5.0, gt=0, le=3600,
        description="seconds a checker may take before it counts as UNKNOWN"
    )
    sweep_poll_interval: float = Field(
        default=1.0, ge=0.01, le=3600,
        description="longest the sweeper sleeps before looking for due rows"
    )


class StatusSettings(DatabaseSettings, _Leases, _CheckTiming):
    """What ``outbox status`` and the console read, and no more: a bad setting of the
    relay's Kafka or of a reconciliation does not stop a look at the outbox."""


class _Partitioning(_Base):
    """How many message ids a range of history holds: ``outbox db upgrade`` makes the first
    ranges, the relay's retention and ``outbox prune`` the next ones."""

    partition_size: int = Field(
        default=PARTITION_SIZE, gt=0, le=10**12,
        description="message ids per new partition, at least (a multiple at high rates, so "
                    "the window holds about 24); retention drops whole partitions"
    )


class MigrateSettings(DatabaseSettings, _Partitioning):
    """What ``outbox db`` reads: a migration job that shares the relay's variables is not
    stopped by a Kafka or batch setting it never uses."""


class PruneSettings(DatabaseSettings, _Partitioning):
    """What a retention pass reads (``outbox prune``, and the relay's): no Kafka setting."""

    retention_hours: float = Field(
        default=72.0, gt=0, le=24 * 3650,
        description="partitions of delivered and rolled-back rows are dropped after this"
    )
    prune_batch_size: int = Field(
        default=5000, gt=0, le=INT32_MAX,
        description="default-partition rows deleted per statement"
    )


class RelaySettings(PruneSettings, KafkaSettings, _Leases):
    """The relay daemon: batches, leases, parking, metrics and retention."""

    relay_batch_size: int = Field(default=2000, gt=0, le=100_000,
                                  description="messages fetched and sent per batch")
    relay_batch_bytes: int = Field(
        default=RELAY_BATCH_BYTES, ge=1024, le=1024 * 1024 * 1024,
        description="payload bytes per batch (a batch always holds at least one message)"
    )
    relay_poll_interval: float = Field(
        default=1.0, ge=0.01, le=3600, description="seconds between polls when no NOTIFY arrives"
    )
    relay_max_attempts: int = Field(  # each a pass at once, without a log line: bounded
        default=5, gt=0, le=100,
        description="permanent rejections before a message is parked"
    )
    relay_stop_timeout: float = Field(  # under a second, even an idle relay abandoned its
        default=20.0, ge=1, le=3600,    # work and kept its shards until their leases lapsed
        description="seconds a stopping relay waits for the batches in flight; then it "
        "abandons them (they stay pending), as a second signal does"
    )
    relay_tail_max_records: int = Field(
        default=1_000_000, gt=0,
        description="records read at most from partition tails when settling the shards a "
        "dead relay held, or the sends a failed pass left unrecorded (beyond it: send anyway, "
        "duplicates possible)"
    )
    topic_hold_park_after: float | None = Field(
        default=None, gt=0, le=3650 * 86400,
        description="seconds a topic Kafka does not know is held before its messages are "
        "parked (unset: held until the topic appears)"
    )
    relay_metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="serve Prometheus metrics on this port"
    )
    prune_interval: float = Field(
        default=60.0, ge=1, le=86400, description="seconds between the relay's retention passes"
    )


class SweepSettings(DatabaseSettings, _CheckTiming):
    """The check-back sweeper (RocketMQ's names and defaults)."""

    check_interval: float = Field(
        default=30.0, gt=0, le=86400,
        description="seconds between check-backs of an UNKNOWN message"
    )
    check_max: int = Field(  # at most what pending.check_count (an integer) holds
        default=15, gt=0, le=2**31 - 1,
        description="inconclusive check-backs before a message is discarded",
    )
    sweep_concurrency: int = Field(default=8, gt=0, le=256, description="checks run at once")
    sweep_batch_size: int = Field(default=500, gt=0, le=100_000,
                                  description="most messages claimed per sweep round")
    sweep_metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="serve the sweeper's metrics on this port"
    )
    #: Each runs as the role ``<schema>_checker`` (``outbox db upgrade --create-roles``): the
    #: sweeper prepares it after ``SET LOCAL ROLE`` and runs it inside a SECURITY DEFINER
    #: function that role owns, where PostgreSQL refuses any switch back to the sweeper's role.
    #: One statement (PostgreSQL refuses more), read-only, under ``checker_timeout``; refused
    #: at sweeper start when PostgreSQL cannot prepare it.
    sql_checkers: dict[str, str] = Field(
        default_factory=dict,
        description="producer group -> one SQL query returning COMMIT, ROLLBACK or UNKNOWN "
        "(JSON); runs as <schema>_checker",
    )

    @field_validator("sql_checkers")
    @classmethod
    def _sql_checkers(cls, value: dict[str, str]) -> dict[str, str]:
        for group, sql in value.items():
            if not group or not sql.strip():
                raise ValueError("each entry maps a producer group to a non-empty SQL query")
        return value


#: The masters Spark 4 starts under (``SparkContext.createTaskScheduler``, spark-submit).
_SPARK_MASTER = re.compile(
    r"local|local\[(\*|[1-9][0-9]*)(\s*,\s*[0-9]+)?\]"
    r"|local-cluster\[\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*\]"
    r"|spark://\S+|k8s://\S+|yarn")


class ReconcileSettings(DatabaseSettings, KafkaSettings):
    """The Spark reconciliation job."""

    reconcile_output_dir: str = Field(
        default="reconcile-output", min_length=1,  # empty: the run wrote to the working folder
        description="where reconciliation runs write their files"
    )
    reconcile_sla_seconds: float = Field(
        default=300.0, gt=0, le=3650 * 86400,
        description="a committed message not delivered this long after it was due is a finding",
    )
    reconcile_thresholds: dict[str, int | None] = Field(
        default_factory=dict,
        description="per finding, the count above which a run fails (None: report only); "
        "overrides the defaults in spark/findings.py",
    )
    reconcile_read_topics: bool = Field(
        default=False, description="also read the Kafka topics, not only the outbox tables"
    )

    @field_validator("reconcile_thresholds", mode="before")
    @classmethod
    def _counts(cls, value: object) -> object:
        """A TOML ``true`` was read as a threshold of 1 (see _no_boolean_for_a_number)."""
        if isinstance(value, dict):
            for name, count in value.items():
                if isinstance(count, bool):
                    raise ValueError(f"{str(count).lower()} given for {name}: a threshold is "
                                     "a count, or none")
        return value

    @field_validator("reconcile_thresholds")
    @classmethod
    def _known_findings(cls, value: dict[str, int | None]) -> dict[str, int | None]:
        from outbox import findings

        try:
            findings.thresholds(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
        return value
    reconcile_partitions: int = Field(
        default=8, gt=0, le=1024, description="parallel JDBC reads per table at most (one per "
        "core of the Spark session, more only to keep a read at 2.5M rows)"
    )
    reconcile_spark_master: str = Field(
        default="", description="Spark master; empty: spark-submit's, or local[*] from the CLI"
    )

    @field_validator("reconcile_spark_master")
    @classmethod
    def _spark_master(cls, value: str) -> str:
        """Spark's own refusal came after its start, as a Java traceback and exit code 1."""
        if value and not _SPARK_MASTER.fullmatch(value):
            raise ValueError(f"{value!r} is not a Spark master: write local, local[N], "
                             "local[*], spark://HOST:PORT, yarn or k8s://HOST:PORT")
        return value

    reconcile_jdbc_jar: str = Field(
        default="/usr/share/java/postgresql.jar",
        description="the PostgreSQL JDBC driver jar (Debian: libpostgresql-jdbc-java)",
    )
    reconcile_progress_seconds: float = Field(
        default=30.0, gt=0, le=86400, description="seconds between the progress lines a run "
        "logs while its Spark jobs work (none for a run quicker than that)"
    )


class ConsoleSettings(StatusSettings):
    """The operator console (``outbox console``, the ``console`` extra)."""

    console_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="address the console listens on (loopback unless you put it behind auth)")
    console_port: int = Field(default=8089, ge=0, le=65535, description="the console's port")
    console_actions: bool = Field(
        default=False, description="offer resume actions (they also need console_token)")
    console_token: SecretStr = Field(
        default=SecretStr(""), description="the token an operator types to resume messages")
    console_metrics_urls: list[str] = Field(
        default_factory=list,
        description="the relays' and sweepers' /metrics URLs the console shows (JSON list)")
    console_refresh_seconds: float = Field(
        default=5.0, ge=1, le=3600, description="seconds between the page's refreshes")
    console_allowed_hosts: list[str] = Field(
        default_factory=list,
        description="host names the console answers to (JSON list; '*.example.com' allowed); "
        "empty: the loopback names while it listens on loopback, any name otherwise")

    @field_validator("console_metrics_urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        """Only http(s): the page fetches each one (``file://`` would read a local file)."""
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http:// or https:// URL")
        return urls


class Settings(PublishSettings, RelaySettings, SweepSettings, ReconcileSettings,
               ConsoleSettings):
    """Every setting at once: what ``outbox config`` prints; valid wherever a part is wanted."""


S = TypeVar("S", bound=_Base)


def load_settings(cls: type[S] = Settings, **overrides: Any) -> S:  # type: ignore[assignment]
    """Build ``cls`` from its sources, turning validation errors into one line per bad field,
    each named as the user wrote it (keyword, variable or config file key)."""
    given = _given(overrides)
    try:
        return cls(**given)
    except SettingsError as exc:
        raise ConfigurationError(_unparsed(exc)) from None
    except ValidationError as exc:
        raise ConfigurationError(_one_line(exc, _keywords(overrides), sources=True)) from None


def _unparsed(exc: SettingsError) -> str:
    """A JSON setting its source could not parse, named as it was written (pydantic says
    'error parsing value for field "sql_checkers" from source "EnvSettingsSource"')."""
    why = "" if exc.__cause__ is None else f": {first_line(exc.__cause__)}"
    found = re.search(r'field "(\w+)" from source "_Environment"', str(exc))
    if found is None:
        return f"invalid settings: {exc} (expected JSON{why})"
    if isinstance(exc.__cause__, _KeyTwice):
        return f"invalid settings: OUTBOX_{found.group(1).upper()} {exc.__cause__}"
    return f"invalid settings: OUTBOX_{found.group(1).upper()} is not valid JSON{why}"


def with_overrides(settings: S, **overrides: Any) -> S:
    """``settings`` with some values replaced and validated again (no source is re-read)."""
    try:
        return type(settings).model_validate({**settings.model_dump(), **_given(overrides)})
    except ValidationError as exc:  # only the overrides are new: no source is named
        raise ConfigurationError(_one_line(exc, _keywords(overrides), sources=False)) from None


def _given(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides actually given (None means "not given"); ``schema`` is ``schema_name``."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "schema" in given:
        given["schema_name"] = given.pop("schema")
    return given


def _keywords(overrides: dict[str, Any]) -> dict[str, str]:
    """Each field given as a keyword argument (or a flag's) to the name it was given by."""
    return {("schema_name" if name == "schema" else name): name
            for name, value in overrides.items() if value is not None}


def _one_line(exc: ValidationError, keywords: Mapping[str, str], *, sources: bool) -> str:
    """``name: message; ...``, each bad value named as the user wrote it (a rule across fields
    names them in its message)."""
    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            lines.append(message)
            continue
        field = _field(str(err["loc"][0]))
        name = keywords.get(field) or (_written(field) if sources else field)
        inside = ".".join(str(part) for part in err["loc"][1:])
        lines.append(f"{name}{f' at {inside}' if inside else ''}: {message}")
    return "invalid settings: " + "; ".join(lines)


def _field(name: str) -> str:
    """A field's name from an error's location, which names the schema by its alias."""
    for field, info in Settings.model_fields.items():
        if name in (field, info.validation_alias):
            return field
    return name


def _written(field: str) -> str:
    """Where a field's value came from, the sources in their order (flags are keywords): the
    variable as it is spelled in the environment, else the config file's key; a default or
    an unknown keyword keeps the field's name."""
    variables = _variables()
    spelled = sorted(name for name in os.environ if variables.get(name.upper()) == field)
    if spelled:  # several agree (_one_variable_per_setting): any one is where it came from
        return spelled[0]
    config_file = os.environ.get(CONFIG_ENV)
    if config_file:
        try:
            with open(config_file, "rb") as file:
                keys = tomllib.load(file)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):  # refused when read
            keys = {}
        for key in keys:
            if key.lower() == field:
                return f"key {key!r} in config file {config_file}"
    return field
