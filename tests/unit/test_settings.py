"""One settings model: flags > OUTBOX_* variables > config file > defaults, secrets masked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from outbox.relay.producer import producer_config
from outbox.settings import Settings
from tests.processes import run_outbox


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**env, **extra}


def effective(*args: str, env: dict[str, str]) -> dict[str, object]:
    result = run_outbox(None, *args, "config", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


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
                    OUTBOX_KAFKA_SECURITY_PROTOCOL="SASL_SSL")
    result = run_outbox(None, "config", env=env)
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout and "kafka-secret" not in result.stdout
    assert "postgresql://app:***@db:5432/shop" in result.stdout


def test_kafka_sasl_and_tls_settings_reach_the_producer() -> None:
    settings = Settings(kafka_bootstrap="k1:9093,k2:9093", kafka_security_protocol="SASL_SSL",
                        kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="relay",
                        kafka_sasl_password="s3cret", kafka_ssl_cafile="/etc/ca.pem")
    config = producer_config(settings)
    assert config["bootstrap_servers"] == ["k1:9093", "k2:9093"]
    assert config["security_protocol"] == "SASL_SSL"
    assert config["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl_plain_username"], config["sasl_plain_password"]) == ("relay", "s3cret")
    assert config["ssl_cafile"] == "/etc/ca.pem"
    assert config["acks"] == "all" and config["enable_idempotence"] is True
    assert "s3cret" not in repr(settings)


def test_outbox_arguments_override_the_settings_it_is_given() -> None:
    from outbox import Outbox

    base = Settings(database_url="postgresql://app@db/shop", max_payload_bytes=5000)
    outbox = Outbox(settings=base, schema="billing", max_payload_bytes=10)
    assert (outbox.schema, outbox.settings.max_payload_bytes) == ("billing", 10)
    assert outbox.settings.database_url == base.database_url
    assert Outbox(settings=base).settings is base
