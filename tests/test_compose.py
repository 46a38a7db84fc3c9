"""docker-compose.yml cannot run here (no Docker engine): check what it asks of the CLI."""

from __future__ import annotations

from pathlib import Path

import yaml

from outbox.settings import Settings

COMPOSE = yaml.safe_load((Path(__file__).parent.parent / "docker-compose.yml").read_text())


def test_compose_runs_the_migration_then_the_relay() -> None:
    services = COMPOSE["services"]
    assert {"postgres", "kafka", "migrate", "relay"} <= set(services)
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["relay"]["command"] == ["relay"]
    assert services["relay"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully")


def test_compose_settings_are_ones_the_cli_knows() -> None:
    for name in ("migrate", "relay"):
        env = COMPOSE["services"][name]["environment"]
        fields = {f"OUTBOX_{field.upper()}" for field in Settings.model_fields} | {
            "OUTBOX_SCHEMA"}
        assert set(env) <= fields, set(env) - fields
        Settings(**{k.removeprefix("OUTBOX_").lower().replace("schema", "schema_name"): v
                    for k, v in env.items()})


def test_compose_images_are_pinned() -> None:
    for service in COMPOSE["services"].values():
        if "image" in service:
            assert ":" in service["image"] and not service["image"].endswith(":latest")
