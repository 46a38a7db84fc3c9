"""docker-compose.yml's database behaves like a production one (no Docker engine needed)."""

from __future__ import annotations

from pathlib import Path

import yaml
from sqlalchemy import make_url

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())


def test_the_database_user_is_not_named_like_the_outbox_schema() -> None:
    """PostgreSQL's default search_path starts with "$user": a user named like the schema
    would put the application's own tables into the outbox's schema."""
    outbox_env = COMPOSE["x-outbox-env"]
    user = COMPOSE["services"]["postgres"]["environment"]["POSTGRES_USER"]
    assert make_url(outbox_env["OUTBOX_DATABASE_URL"]).username == user
    assert user != outbox_env.get("OUTBOX_SCHEMA", "outbox")
