"""docker-compose.yml cannot run here (no Docker engine): it is checked against the Compose
specification's JSON schema, and every command it runs is run here against the suite's
services, health check included."""

from __future__ import annotations

import importlib.util
import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from sqlalchemy import Engine

from outbox.dev import services as devservices
from outbox.settings import Settings
from tests.conftest import wait_until
from tests.monitoring import promtool
from tests.processes import outbox_env, run_outbox, start_outbox

ROOT = Path(__file__).parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_schema() -> dict[str, Any]:
    """The Compose specification schema shipped in docker-compose 1.29.2's wheel (installed
    by scripts/bootstrap.sh without its dependencies; the package is never imported)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations
    location = Path(next(iter(spec.submodule_search_locations)))
    return json.loads((location / "config" / "compose_spec.json").read_text())


def test_compose_file_follows_the_compose_specification() -> None:
    validator = jsonschema.Draft201909Validator(compose_schema())
    assert [error.message for error in validator.iter_errors(COMPOSE)] == []
    broken = {**COMPOSE, "services": {**COMPOSE["services"], "relay": {
        **COMPOSE["services"]["relay"], "comand": ["relay"]}}}
    assert list(validator.iter_errors(broken)), "the schema check can fail"


def test_compose_deploys_what_a_team_needs() -> None:
    services = COMPOSE["services"]
    assert {"postgres", "kafka", "migrate", "relay", "sweeper", "prometheus"} <= set(services)
    assert services["relay"]["deploy"]["replicas"] == 2
    for name in ("relay", "sweeper"):
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully")
        assert "healthcheck" in services[name]
    for service in services.values():
        assert ":" in service["image"] and not service["image"].endswith(":latest")


def test_compose_settings_are_ones_the_cli_knows() -> None:
    env = COMPOSE["services"]["relay"]["environment"]
    known = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields} | {"OUTBOX_SCHEMA"}
    assert set(env) <= known, set(env) - known


def metrics_port(service: str) -> str:
    command = COMPOSE["services"][service]["command"]
    return str(command[command.index("--metrics-port") + 1])


def prometheus_config() -> Path:
    """The configuration file the prometheus service loads, on this side of its volume."""
    service = COMPOSE["services"]["prometheus"]
    (flag,) = [arg for arg in service["command"] if arg.startswith("--config.file=")]
    inside = Path(flag.partition("=")[2])
    mounts = dict(reversed(volume.split(":")[:2]) for volume in service["volumes"])
    return ROOT / mounts[str(inside.parent)] / inside.name


def test_prometheus_scrapes_every_relay_and_the_sweeper_on_their_metrics_ports() -> None:
    config = yaml.safe_load(prometheus_config().read_text())
    discovery = {job["job_name"]: job["dns_sd_configs"] for job in config["scrape_configs"]}
    for job, service in (("outbox-relay", "relay"), ("outbox-sweeper", "sweeper")):
        port = metrics_port(service)
        assert discovery[job] == [{"names": [service], "type": "A", "port": int(port),
                                   "refresh_interval": "30s"}]
        assert COMPOSE["services"][service]["expose"] == [port]


def test_prometheus_loads_the_alert_rules() -> None:
    config = prometheus_config()
    rule_files = yaml.safe_load(config.read_text())["rule_files"]
    assert rule_files == ["alerts.yml"] and (config.parent / "alerts.yml").is_file()

    checked = promtool("check", "config", str(config))

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def compose_env(settings: Settings) -> dict[str, str]:
    """The compose file's OUTBOX_* settings, pointed at the suite's services."""
    env = dict(COMPOSE["services"]["relay"]["environment"])
    env.update(OUTBOX_DATABASE_URL=settings.database_url,
               OUTBOX_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
               OUTBOX_SCHEMA=settings.schema_name)
    return outbox_env(settings, **env)


def _run_postgres_init_scripts(engine: Engine, schema: str) -> None:
    """What the postgres service runs on its first start (its /docker-entrypoint-initdb.d
    mounts), with the checker role named after this test's schema."""
    mounts = [v.split(":") for v in COMPOSE["services"]["postgres"]["volumes"]]
    scripts = [ROOT / source for source, target, *_ in mounts
               if target.startswith("/docker-entrypoint-initdb.d/")]
    assert scripts, "the postgres service creates the tables its SQL checker reads"
    with engine.begin() as conn:
        for script in scripts:
            conn.exec_driver_sql(script.read_text().replace("outbox_checker",
                                                            f"{schema}_checker"))


def test_every_compose_command_runs(settings: Settings, engine: Engine) -> None:
    services = COMPOSE["services"]
    env = compose_env(settings)
    migrate = run_outbox(None, *services["migrate"]["command"], env=env)
    assert migrate.returncode == 0, migrate.stderr
    _run_postgres_init_scripts(engine, settings.schema_name)
    for name in ("relay", "sweeper"):
        command = list(services[name]["command"])
        port = devservices.free_port()
        command[command.index("--metrics-port") + 1] = str(port)
        process = start_outbox(settings, *command, **{
            k: v for k, v in env.items() if k.startswith("OUTBOX_")})
        try:
            wait_until(lambda port=port: _healthy(port), 30, f"{name}'s health check")
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output
        health = services[name]["healthcheck"]["test"]
        assert f"127.0.0.1:{metrics_port(name)}/metrics" in health[-1]


@pytest.mark.slow
def test_the_reconcile_job_runs_its_command(settings: Settings, tmp_path: Path) -> None:
    """``docker compose run --rm reconcile``: its image's target has Java and the spark extra
    (tests/unit/test_dockerfile.py); here its command runs against the suite's services."""
    service = COMPOSE["services"]["reconcile"]
    assert service["build"]["target"] == "reconcile" and service["profiles"] == ["reconcile"]
    env = {**compose_env(settings), "OUTBOX_RECONCILE_OUTPUT_DIR": str(tmp_path)}

    done = run_outbox(None, *service["command"], env=env)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("outbox reconciliation run 1: CLEAN")
    assert any(tmp_path.iterdir())


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False
