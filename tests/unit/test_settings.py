"""One settings model: flags > OUTBOX_* variables > config file > defaults, secrets masked."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import make_url

from outbox.exceptions import ConfigurationError
from outbox.relay.producer import producer_config
from outbox.settings import (
    ConsoleSettings,
    DatabaseSettings,
    PublishSettings,
    ReconcileSettings,
    RelaySettings,
    Settings,
    StatusSettings,
    SweepSettings,
    load_settings,
    mask_url,
    sqlalchemy_url,
    unknown_variables,
    validate_identifier,
    with_overrides,
)
from outbox.spark.sources import jdbc_options
from tests.processes import run_outbox


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**env, **extra}


def effective(*args: str, env: dict[str, str]) -> dict[str, object]:
    result = run_outbox(None, *args, "config", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def use_config(tmp_path: Path, toml: str) -> None:
    """A config file holding ``toml``, named by OUTBOX_CONFIG."""
    config = tmp_path / "outbox.toml"
    config.write_text(toml)
    os.environ["OUTBOX_CONFIG"] = str(config)


def test_flags_beat_environment_beats_config_file_beats_defaults(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text('schema_name = "from_file"\nrelay_batch_size = 111\n'
                      'relay_lease_seconds = 7.5\n')
    env = clean_env(OUTBOX_CONFIG=str(config), OUTBOX_RELAY_BATCH_SIZE="222",
                    OUTBOX_SCHEMA="from_env")
    values = effective(env=env)
    assert values["relay_lease_seconds"] == 7.5  # file over default
    assert values["relay_batch_size"] == 222  # environment over file
    assert values["schema_name"] == "from_env"
    assert values["check_max"] == 15  # default
    flagged = run_outbox(None, "--config", str(config), "--schema", "from_flag", "config",
                         "--json", env=clean_env())
    assert json.loads(flagged.stdout)["schema_name"] == "from_flag"
    assert json.loads(flagged.stdout)["relay_batch_size"] == 111


def test_config_errors_are_one_clear_line(tmp_path: Path) -> None:
    missing = run_outbox(None, "--config", str(tmp_path / "nope.toml"), "config",
                         env=clean_env())
    assert missing.returncode == 2
    assert "config file" in missing.stderr and "not found" in missing.stderr
    typo = tmp_path / "typo.toml"
    typo.write_text("relay_bach_size = 5\n")
    bad = run_outbox(None, "--config", str(typo), "config", env=clean_env())
    assert bad.returncode == 2
    assert "relay_bach_size" in bad.stderr and "Traceback" not in bad.stderr


def test_secrets_are_masked_in_config_output() -> None:
    env = clean_env(OUTBOX_DATABASE_URL="postgresql://app:hunter2@db:5432/shop",
                    OUTBOX_KAFKA_SASL_PASSWORD="kafka-secret",
                    OUTBOX_KAFKA_SASL_MECHANISM="PLAIN", OUTBOX_KAFKA_SASL_USERNAME="relay",
                    OUTBOX_KAFKA_SECURITY_PROTOCOL="SASL_SSL")
    result = run_outbox(None, "config", env=env)
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout and "kafka-secret" not in result.stdout
    assert "postgresql://app:***@db:5432/shop" in result.stdout


def test_kafka_sasl_and_tls_settings_reach_the_producer(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").touch()
    settings = Settings(kafka_bootstrap="k1:9093,k2:9093", kafka_security_protocol="SASL_SSL",
                        kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="relay",
                        kafka_sasl_password="s3cret", kafka_ssl_cafile=str(tmp_path / "ca.pem"))
    config = producer_config(settings)
    assert config["bootstrap_servers"] == ["k1:9093", "k2:9093"]
    assert config["security_protocol"] == "SASL_SSL"
    assert config["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl_plain_username"], config["sasl_plain_password"]) == ("relay", "s3cret")
    assert config["ssl_cafile"] == str(tmp_path / "ca.pem")
    assert config["acks"] == "all" and config["enable_idempotence"] is True
    assert "s3cret" not in repr(settings)


def test_outbox_arguments_override_the_settings_it_is_given() -> None:
    from outbox import Outbox

    base = Settings(database_url="postgresql://app@db/shop", max_payload_bytes=5000)
    outbox = Outbox(settings=base, schema="billing", max_payload_bytes=10)
    assert (outbox.schema, outbox.settings.max_payload_bytes) == ("billing", 10)
    assert outbox.settings.database_url == base.database_url
    assert Outbox(settings=base).settings is base


# In process: the component classes, their sources and the helpers ----------------------------

COMPONENTS = (PublishSettings, RelaySettings, SweepSettings, ReconcileSettings,
              ConsoleSettings)


def test_each_component_takes_only_its_own_settings() -> None:
    assert set(Settings.model_fields) == set().union(*(c.model_fields for c in COMPONENTS))
    assert "relay_batch_size" not in PublishSettings.model_fields
    assert "kafka_bootstrap" not in SweepSettings.model_fields
    with pytest.raises(ConfigurationError, match="relay_batch_size: Extra inputs"):
        load_settings(PublishSettings, relay_batch_size=5)


def test_the_library_ignores_what_only_the_outbox_s_own_processes_read(tmp_path: Path) -> None:
    """A log level or connection timeout meant for the relay, wrong in the environment or the
    shared file, stopped every application that made an ``Outbox()`` (the library logs
    through the application's logging and publishes on its connections); the relay still
    refuses them."""
    from outbox import Outbox

    config = tmp_path / "outbox.toml"
    config.write_text('database_tcp_timeout = 0\n')
    os.environ.update(OUTBOX_CONFIG=str(config), OUTBOX_LOG_LEVEL="chatty")
    assert Outbox().settings.schema_name == "outbox"
    with pytest.raises(ConfigurationError,
                       match=r"'database_tcp_timeout' in config file .*; OUTBOX_LOG_LEVEL: "):
        load_settings(RelaySettings)


def test_a_component_reads_its_keys_from_a_file_shared_with_the_others(tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text('schema_name = "shop"\ncheck_max = 3\nrelay_batch_size = 9\n')
    os.environ.update(OUTBOX_CONFIG=str(config), OUTBOX_CHECK_MAX="4")
    sweep = load_settings(SweepSettings, check_interval=2.5)
    assert (sweep.schema_name, sweep.check_max, sweep.check_interval) == ("shop", 4, 2.5)
    assert load_settings(RelaySettings).relay_batch_size == 9


def test_an_unknown_key_in_the_file_names_the_key(tmp_path: Path) -> None:
    use_config(tmp_path, "relay_bach_size = 5\n")
    with pytest.raises(ConfigurationError, match="unknown key 'relay_bach_size' in config file"):
        load_settings(RelaySettings)


def test_invalid_values_are_one_line_per_field() -> None:
    with pytest.raises(ConfigurationError) as error:
        load_settings(SweepSettings, check_max=0, sweep_concurrency=1000)
    assert str(error.value).startswith("invalid settings: check_max: ")
    assert "; sweep_concurrency: " in str(error.value) and "\n" not in str(error.value)
    for value, why in (("{not json", "Expecting property name enclosed in double quotes"),
                       ("", "Expecting value")):
        os.environ["OUTBOX_SQL_CHECKERS"] = value
        with pytest.raises(ConfigurationError) as error:
            load_settings(SweepSettings)
        assert str(error.value).startswith(
            f"invalid settings: OUTBOX_SQL_CHECKERS is not valid JSON: {why}"), error.value


def refusal(load: Callable[[], object]) -> str:
    with pytest.raises(ConfigurationError) as error:
        load()
    return str(error.value)


def test_a_bad_value_is_named_as_the_user_wrote_it(tmp_path: Path) -> None:
    """Errors named the field (``max_payload_bytes``), which is neither the variable the user
    set nor, in its case, the config file's key: they now name the variable, as written, or
    the key and its file; a keyword argument (a flag's) keeps its own name."""
    from outbox import Outbox

    os.environ["OUTBOX_MAX_PAYLOAD_BYTES"] = "abc"
    assert refusal(Outbox).startswith(
        "invalid settings: OUTBOX_MAX_PAYLOAD_BYTES: Input should be a valid integer")
    del os.environ["OUTBOX_MAX_PAYLOAD_BYTES"]
    lower_case = "outbox_relay_batch_size"
    os.environ[lower_case] = "-1"
    assert refusal(lambda: load_settings(RelaySettings)) == (
        f"invalid settings: {lower_case}: Input should be greater than 0")
    del os.environ[lower_case]
    use_config(tmp_path, 'RELAY_BATCH_SIZE = -1\nschema_name = "Bad"\n')
    where = f"in config file {tmp_path / 'outbox.toml'}"
    assert refusal(lambda: load_settings(RelaySettings)) == (
        f"invalid settings: key 'schema_name' {where}: invalid schema name 'Bad': use "
        "lower-case letters, digits and '_' (at most 53 characters, not starting with a "
        f"digit); key 'RELAY_BATCH_SIZE' {where}: Input should be greater than 0")
    del os.environ["OUTBOX_CONFIG"]
    os.environ["OUTBOX_SCHEMA"] = "Also_Bad"
    assert refusal(lambda: load_settings(PublishSettings)).startswith(
        "invalid settings: OUTBOX_SCHEMA: invalid schema name 'Also_Bad'")
    del os.environ["OUTBOX_SCHEMA"]
    for keyword in (lambda: load_settings(PublishSettings, schema="No-Way"),
                    lambda: Outbox(settings=Settings(), schema="No-Way")):
        assert refusal(keyword).startswith(
            "invalid settings: schema: invalid schema name 'No-Way'")


def test_a_json_setting_that_gives_a_key_twice_is_refused_naming_it() -> None:
    """The last of the two silently won: a second checker of a group pasted below the
    first replaced it without a word."""
    os.environ["OUTBOX_SQL_CHECKERS"] = ('{"orders": "SELECT \'COMMIT\'", '
                                         '"orders": "SELECT \'ROLLBACK\'"}')
    with pytest.raises(ConfigurationError) as error:
        load_settings(SweepSettings)
    assert str(error.value) == ("invalid settings: OUTBOX_SQL_CHECKERS gives the key "
                                "'orders' twice"), error.value


def test_a_threshold_of_true_in_the_file_is_not_taken_for_one(tmp_path: Path) -> None:
    use_config(tmp_path, "[reconcile_thresholds]\ndiscarded = true\n")
    with pytest.raises(ConfigurationError, match=r"'reconcile_thresholds' in config file "
                       r".*: true given for "
                       r"discarded: a threshold is a count"):
        load_settings(ReconcileSettings)


def test_check_max_is_bounded_by_what_a_check_count_holds() -> None:
    with pytest.raises(ConfigurationError, match="check_max: Input should be less than or "
                       "equal to 2147483647"):
        load_settings(SweepSettings, check_max=2**31)


@pytest.mark.parametrize(("bootstrap", "problem"), [
    ("kafka1:9O92", "port '9O92'"), ("k1:9092,,k2:9092", "an empty entry"),
    ("::1:9092", "without brackets"), (":9092", "an empty host"), ("k1:70000", "port '70000'"),
    ("PLAINTEXT://kafka:9092", "'PLAINTEXT://kafka:9092' is a listener: write kafka:9092"),
    ("k1:\uff19\uff10\uff19\uff12", "port '\uff19\uff10\uff19\uff12'"),  # full-width
    ("k1:\u00b2", "port '\u00b2'"),  # a superscript two: int() of it raised
    ("k1 k2:9092", "'k1 k2:9092' holds a space or a semicolon"),  # failed as no broker
    ("k1:9092;k2:9092", "'k1:9092;k2:9092' holds a space or a semicolon"),  # "IPv6 address"
    ("[::1:9092", "'[::1:9092' has no closing ']'"),  # kafka-python's traceback, 79 lines
])
def test_a_bootstrap_list_is_checked_when_the_settings_load(bootstrap: str, problem: str
                                                            ) -> None:
    """A port kafka-python could not parse was a traceback after the relay had started."""
    with pytest.raises(ConfigurationError, match=f"kafka_bootstrap: .*{re.escape(problem)}"):
        load_settings(RelaySettings, kafka_bootstrap=bootstrap)


def test_a_bootstrap_list_loses_its_spaces_and_keeps_ipv6_in_brackets() -> None:
    settings = load_settings(RelaySettings, kafka_bootstrap=" k1:9092, [::1]:9093 ,k3")
    assert settings.kafka_bootstrap == "k1:9092,[::1]:9093,k3"


@pytest.mark.parametrize(("field", "value"), [
    ("kafka_max_request_size", 2), ("kafka_delivery_timeout_ms", 3_000_000_000),
    ("prune_batch_size", 3_000_000_000), ("partition_size", 2**62),
])
def test_sizes_beyond_what_the_clients_and_functions_take_are_refused(field: str, value: int
                                                                      ) -> None:
    """librdkafka's properties and PostgreSQL's integer arguments are 32-bit; a partition
    size near 2^62 overflowed the next range's bounds, and a request size of 2 (meant as
    2 MB) parked every message."""
    with pytest.raises(ConfigurationError, match=field):
        load_settings(RelaySettings, **{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("relay_max_attempts", 101), ("relay_stop_timeout", 0.5),
])
def test_relay_bounds_that_kept_it_from_working_are_refused(field: str, value: float) -> None:
    """A million attempts retried a rejected record in a loop without a pause or a log line
    (15,930 passes in 9 s); a stop timeout of 0.001 s abandoned an idle relay's work and
    left its shards to lapse."""
    with pytest.raises(ConfigurationError, match=field):
        load_settings(RelaySettings, **{field: value})


def test_an_empty_tls_file_variable_is_unset() -> None:
    """``OUTBOX_KAFKA_SSL_CAFILE=`` (Compose passes empty variables) passed the security
    check as unset, then stopped the relay after it had reached PostgreSQL: ``no such
    file``."""
    os.environ.update(OUTBOX_KAFKA_SSL_CAFILE="", OUTBOX_KAFKA_SSL_CERTFILE=" ")
    settings = load_settings(RelaySettings, kafka_bootstrap="k1:9092")
    assert (settings.kafka_ssl_cafile, settings.kafka_ssl_certfile) == (None, None)
    assert "ssl_cafile" not in settings.kafka_security()


@pytest.mark.parametrize("variable", ["OUTBOX_RELAY_METRICS_PORT", "OUTBOX_TOPIC_HOLD_PARK_AFTER"])
def test_an_empty_variable_of_a_setting_that_may_be_unset_is_unset(variable: str) -> None:
    """``OUTBOX_TOPIC_HOLD_PARK_AFTER=`` (Compose's ``${PARK_AFTER:-}``) stopped the relay:
    ``Input should be a valid number``, the empty value not shown, where an empty TLS file
    variable was taken for unset."""
    os.environ[variable] = " "
    settings = load_settings(RelaySettings, kafka_bootstrap="k1:9092")
    assert getattr(settings, variable.removeprefix("OUTBOX_").lower()) is None


@pytest.mark.parametrize(("given", "error"), [
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_username": "relay"},
     "kafka_security_protocol SASL_SSL needs kafka_sasl_mechanism, kafka_sasl_password"),
    ({"kafka_sasl_username": "relay"},
     "kafka_sasl_username set, but kafka_security_protocol PLAINTEXT does not use it"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN",
      "kafka_sasl_username": "relay", "kafka_sasl_password": "pw",
      "kafka_ssl_cafile": "/etc/ca.pem"},
     "kafka_ssl_cafile set, but kafka_security_protocol SASL_PLAINTEXT does not use it"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_keyfile": "/etc/relay.key"},
     "kafka_ssl_keyfile set without kafka_ssl_certfile, the client certificate it is the key "
     "of (kafka-python would connect without either)"),
])
def test_half_set_kafka_security_is_refused_when_the_settings_load(given: dict[str, str],
                                                                    error: str) -> None:
    """kafka-python waited for its connect timeout, then said no broker answers;
    librdkafka named a mechanism (GSSAPI) no one had set. A client key without its
    certificate: kafka-python ignored it and connected without a client certificate
    (librdkafka refused it)."""
    with pytest.raises(ConfigurationError) as raised:
        load_settings(RelaySettings, **given)
    assert str(raised.value) == f"invalid settings: {error}"


def test_a_database_url_from_a_secret_file_loses_its_newline() -> None:
    os.environ["OUTBOX_DATABASE_URL"] = " postgresql://app@db/shop\n"
    assert load_settings(DatabaseSettings).database_url == "postgresql://app@db/shop"


def test_a_kafka_login_from_a_secret_file_loses_its_newline() -> None:
    """A SASL password read from a file (a Kubernetes secret made with --from-file) ended in
    a newline: the broker refused the login, and the relay said no broker answers."""
    os.environ.update(OUTBOX_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
                      OUTBOX_KAFKA_SASL_MECHANISM="PLAIN", OUTBOX_KAFKA_SASL_USERNAME="relay\n",
                      OUTBOX_KAFKA_SASL_PASSWORD="s3cret\r\n")
    security = load_settings(RelaySettings, kafka_bootstrap="k1:9092").kafka_security()
    assert (security["sasl_plain_username"], security["sasl_plain_password"]) == (
        "relay", "s3cret")


def test_an_unreadable_config_file_is_one_line() -> None:
    os.environ["OUTBOX_CONFIG"] = "/proc/self/mem"  # a file, whose reading fails
    with pytest.raises(ConfigurationError, match="config file /proc/self/mem cannot be read"):
        load_settings(RelaySettings)


def test_with_overrides_replaces_values_and_validates_them_again() -> None:
    base = RelaySettings(database_url="postgresql://app@db/shop", relay_batch_size=10)
    changed = with_overrides(base, schema="billing", relay_batch_size=None, retention_hours=1)
    assert type(changed) is RelaySettings
    assert (changed.schema_name, changed.relay_batch_size, changed.retention_hours) == (
        "billing", 10, 1)
    with pytest.raises(ConfigurationError, match="relay_batch_size"):
        with_overrides(base, relay_batch_size=0)
    with pytest.raises(ConfigurationError, match="invalid schema name 'Bad-Name'"):
        with_overrides(base, schema="Bad-Name")


def test_masked_hides_every_password_and_keeps_the_rest() -> None:
    settings = Settings(database_url="postgresql://app:hunter2@db:5432/shop",
                        kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                        kafka_sasl_username="relay", kafka_sasl_password="kafka-secret",
                        kafka_bootstrap="k:9092")
    masked = settings.masked()
    assert masked["database_url"] == "postgresql://app:***@db:5432/shop"
    assert masked["kafka_sasl_password"] == "***"
    assert masked["kafka_bootstrap"] == "k:9092"
    assert Settings(kafka_sasl_password="").masked()["kafka_sasl_password"] is None  # unset
    assert mask_url("postgresql://app@db/shop") == "postgresql://app@db/shop"


def test_a_missing_required_setting_says_which_flag_or_variable_to_set() -> None:
    with pytest.raises(ConfigurationError, match="database_url is not set: pass --database-url "
                                                 "or set OUTBOX_DATABASE_URL"):
        DatabaseSettings().require("database_url")


@pytest.mark.parametrize("name", ["outbox", "_private", "t_0123456789ab", "a" * 53])
def test_plain_lower_case_identifiers_are_valid(name: str) -> None:
    assert validate_identifier(name) == name


@pytest.mark.parametrize("name", ["", "Outbox", "9lives", "a-b", "a b", "x;drop", "a" * 64])
def test_identifiers_that_would_need_quoting_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"invalid role name {name!r}"):
        validate_identifier(name, "role")


def test_database_urls_are_pinned_to_psycopg_3() -> None:
    assert sqlalchemy_url("postgresql://app:pw@db:5432/shop") == (
        "postgresql+psycopg://app:pw@db:5432/shop")
    assert sqlalchemy_url("postgresql+psycopg2://db/shop") == "postgresql+psycopg://db/shop"
    assert sqlalchemy_url("postgres://app:pw@db/shop") == "postgresql+psycopg://app:pw@db/shop"
    assert jdbc_options("postgres://app:pw@db/shop")["url"] == "jdbc:postgresql://db:5432/shop"
    wrong_backend = re.escape("must be postgresql://..., got 'mysql'")
    with pytest.raises(ConfigurationError, match=wrong_backend):
        sqlalchemy_url("mysql://app@db/shop")
    with pytest.raises(ConfigurationError, match="invalid database URL 'not a url'"):
        sqlalchemy_url("not a url")


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "1e12", "soon"])
def test_the_topic_hold_bound_must_be_a_finite_positive_duration(value: str) -> None:
    os.environ["OUTBOX_TOPIC_HOLD_PARK_AFTER"] = value
    with pytest.raises(ConfigurationError, match="OUTBOX_TOPIC_HOLD_PARK_AFTER: "):
        load_settings(RelaySettings)


def test_the_topic_hold_bound_is_unset_by_default_and_read_from_the_environment() -> None:
    assert load_settings(RelaySettings).topic_hold_park_after is None
    os.environ["OUTBOX_TOPIC_HOLD_PARK_AFTER"] = "90"
    assert load_settings(RelaySettings).topic_hold_park_after == 90


def test_database_connections_carry_timeouts_for_a_silent_network_and_the_urls_own_win() -> None:
    url = make_url(Settings(database_url="postgresql://u@db:5432/o?keepalives_idle=60",
                            database_tcp_timeout=12).sqlalchemy_url)
    assert dict(url.query) == {"keepalives_idle": "60", "connect_timeout": "12",
                               "keepalives": "1", "keepalives_interval": "2",
                               "keepalives_count": "3", "tcp_user_timeout": "12000"}
    assert make_url(Settings(database_url="postgresql://u@db/o").sqlalchemy_url
                    ).query["tcp_user_timeout"] == "30000"
    with pytest.raises(ValueError, match="database_tcp_timeout"):
        Settings(database_tcp_timeout=0.5)


def test_a_settings_object_printed_shows_no_password() -> None:
    """database_url was a plain string: repr() printed it whole (an error tracker's locals, a
    settings object logged), though the Kafka and console secrets were masked."""
    settings = Settings(database_url="postgresql://app:s3cret@db/shop", console_token="t0ken")
    for shown in (repr(settings), str(settings)):
        assert "s3cret" not in shown and "t0ken" not in shown, shown
        assert "postgresql://app:***@db/shop" in shown
    assert settings.database_url == "postgresql://app:s3cret@db/shop"


def test_a_settings_error_does_not_echo_the_input() -> None:
    """pydantic's error text shows the input (the whole dict of settings, URL and all) for a
    model-wide check: constructing settings by hand printed the password in a traceback."""
    with pytest.raises(ValidationError) as error:
        Settings(database_url="postgresql://app:s3cret@db/shop", kafka_sasl_password="k4fka")
    assert "kafka_sasl_password set" in str(error.value)
    assert "s3cret" not in str(error.value) and "k4fka" not in str(error.value), error.value


def test_a_key_in_the_file_is_read_in_any_case_by_every_component(tmp_path: Path) -> None:
    """A component took a key in capitals only if it was one of its own: `RELAY_BATCH_SIZE`
    was the relay's, and the sweeper and `outbox status` refused it as unknown."""
    use_config(tmp_path, "RELAY_BATCH_SIZE = 9\nRelay_Lease_Seconds = 30\n")
    relay = load_settings(RelaySettings)
    assert (relay.relay_batch_size, relay.relay_lease_seconds) == (9, 30)
    assert load_settings(StatusSettings).relay_lease_seconds == 30
    assert load_settings(SweepSettings).check_max == 15


@pytest.mark.parametrize("second", ["OUTBOX_SCHEMA_NAME", "outbox_schema"])
def test_two_variables_naming_different_schemas_are_refused(
    monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    """``OUTBOX_SCHEMA`` won over ``OUTBOX_SCHEMA_NAME`` without a word; variables are read in
    any case, and a stray ``outbox_schema`` won (whichever came later in the environment): a
    relay worked on another schema."""
    monkeypatch.setenv(second, "orders_outbox")
    assert load_settings(DatabaseSettings).schema_name == "orders_outbox"
    monkeypatch.setenv("OUTBOX_SCHEMA", "orders_outbox")
    assert load_settings(DatabaseSettings).schema_name == "orders_outbox"
    monkeypatch.setenv("OUTBOX_SCHEMA", "outbox")
    with pytest.raises(ConfigurationError, match=f"OUTBOX_SCHEMA='outbox' and {second}="
                       "'orders_outbox' name different schemas: set OUTBOX_SCHEMA only"):
        load_settings(DatabaseSettings)


def test_two_variables_setting_one_setting_to_different_values_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Variables are read in any case: of two spellings of one, whichever came later in the
    environment silently won. A password is not echoed."""
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "7")
    monkeypatch.setenv("Outbox_Relay_Batch_Size", "9")
    with pytest.raises(ConfigurationError, match="OUTBOX_RELAY_BATCH_SIZE='7' and "
                       "Outbox_Relay_Batch_Size='9' set relay_batch_size to different values: "
                       "set OUTBOX_RELAY_BATCH_SIZE only"):
        load_settings(RelaySettings)
    monkeypatch.delenv("Outbox_Relay_Batch_Size")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://relay:s3cret@db/shop")
    monkeypatch.setenv("outbox_database_url", "postgresql://relay:0ther@db/shop")
    with pytest.raises(ConfigurationError) as error:
        load_settings(RelaySettings)
    assert "set database_url to different values" in str(error.value)
    assert "s3cret" not in str(error.value) and "0ther" not in str(error.value)


@pytest.mark.parametrize("line", ["relay_metrics_port = true", "relay_batch_size = true",
                                  "relay_poll_interval = false", "topic_hold_park_after = true"])
def test_true_or_false_in_the_file_is_not_taken_for_a_number(tmp_path: Path, line: str) -> None:
    """TOML's ``relay_metrics_port = true`` ("serve metrics") served them on port 1, and
    ``relay_batch_size = true`` relayed one message a batch: a boolean was read as 1 or 0."""
    use_config(tmp_path, f"{line}\n")
    field = line.split(" = ")[0]
    with pytest.raises(ConfigurationError,
                       match=f"'{field}' in config file .*: .*is a number, not true or false"):
        load_settings(RelaySettings)


def test_one_setting_given_twice_in_the_file_in_two_cases_is_refused(tmp_path: Path) -> None:
    """Keys are read in any case: ``relay_batch_size = 7`` and ``RELAY_BATCH_SIZE = 9`` in
    one file (TOML takes both) gave 7 without a word."""
    use_config(tmp_path, "relay_batch_size = 7\nRELAY_BATCH_SIZE = 9\n")
    with pytest.raises(ConfigurationError, match=r"keys 'RELAY_BATCH_SIZE' and "
                       r"'relay_batch_size' in config file .* both set relay_batch_size"):
        load_settings(StatusSettings)


def test_an_unknown_variable_in_lower_case_is_reported_too() -> None:
    """Variables are read in any case, but only an unknown one in capitals was reported:
    ``outbox_relay_bach_size`` was ignored without a word."""
    environ = {"outbox_relay_bach_size": "5", "Outbox_Schema": "shop", "OUTBOX_SHCEMA": "x",
               "outbox_config": "outbox.toml"}  # the file is read from OUTBOX_CONFIG only
    assert unknown_variables(environ) == [
        "unknown setting OUTBOX_SHCEMA is ignored (did you mean OUTBOX_SCHEMA?)",
        "unknown setting outbox_config is ignored (did you mean OUTBOX_CONFIG?)",
        "unknown setting outbox_relay_bach_size is ignored (did you mean "
        "OUTBOX_RELAY_BATCH_SIZE?)"]
