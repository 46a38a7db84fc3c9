"""The installed wheel is one namespace: an application with its own top-level ``migrations``
package and ``relay.py`` migrates the outbox and runs its relay from its own root folder
(issue 9's "Done when"). Installed from the real wheel, not the editable checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from outbox.settings import Settings
from tests.conftest import count_status, drop_schema, wait_until
from tests.wheel import build_wheel

TRAP = "raise ImportError('the outbox imported the application\\'s own {}')\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding exactly what ``pip install`` of the built wheel puts in site-packages."""
    wheels, site = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheel = build_wheel(wheels)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return site


@pytest.fixture
def application(tmp_path: Path) -> Path:
    """An application root whose own ``migrations`` (Flask-Migrate style) and ``relay.py``
    fail loudly if anything imports them."""
    app = tmp_path / "app"
    (app / "migrations" / "versions").mkdir(parents=True)
    (app / "migrations" / "__init__.py").write_text(TRAP.format("migrations package"))
    (app / "migrations" / "env.py").write_text(TRAP.format("migrations/env.py"))
    (app / "relay.py").write_text(TRAP.format("relay.py"))
    return app


@pytest.fixture
def app_settings(services: devservices.Services, engine: Engine) -> Iterator[Settings]:
    """Settings for a schema nobody has migrated yet: ``outbox db upgrade`` will."""
    schema = f"p_{uuid.uuid4().hex[:12]}"
    yield Settings(database_url=services.database_url, kafka_bootstrap=services.kafka_bootstrap,
                   schema_name=schema)
    drop_schema(engine, schema)


def installed_env(site: Path, settings: Settings) -> dict[str, str]:
    """The wheel's copy first on the path (the editable install's finder only comes after)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**env, "PYTHONPATH": str(site), "OUTBOX_DATABASE_URL": settings.database_url,
            "OUTBOX_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "OUTBOX_SCHEMA": settings.schema_name, "OUTBOX_RELAY_POLL_INTERVAL": "0.5"}


def test_the_wheel_installs_nothing_but_outbox_at_the_top(site: Path) -> None:
    importable = {entry.name for entry in site.iterdir()
                  if not entry.name.endswith(".dist-info") and entry.name != "bin"}
    assert importable == {"outbox"}
    assert [entry.name for entry in site.glob("*.dist-info")] == [
        "transactional_outbox-0.1.0.dist-info"]
    for part in ("relay/relay.py", "spark/reconcile.py", "migrations/env.py",
                 "migrations/versions/0001_create_outbox_tables.py", "sql/queries.sql",
                 "console/templates/console.html"):
        assert (site / "outbox" / part).is_file(), part


def test_an_app_with_its_own_migrations_and_relay_upgrades_and_relays(
    site: Path, application: Path, app_settings: Settings, engine: Engine, topic: str
) -> None:
    env = installed_env(site, app_settings)

    def outbox(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=application, env=env,
                              capture_output=True, text=True, timeout=120)

    where = outbox("-c", "import outbox; print(outbox.__file__)")
    assert where.stdout.strip() == str(site / "outbox" / "__init__.py"), where.stderr
    for own in ("migrations", "relay"):  # the traps are armed: the app's root is on the path
        assert "imported the application's own" in outbox("-c", f"import {own}").stderr

    upgraded = outbox("-m", "outbox", "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"schema {app_settings.schema_name} is at revision" in upgraded.stdout

    with Session(engine) as session, session.begin():
        message_id = Outbox(settings=app_settings).publish(session, topic, {"n": 1}, key="k")
    relay = subprocess.Popen([sys.executable, "-m", "outbox", "relay"], cwd=application,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: count_status(engine, app_settings.schema_name, "DELIVERED") == 1,
                   60, "the installed relay to deliver the message")
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    assert relay.returncode == 0, output
    assert [r.message_id for r in read_topic(app_settings.kafka_bootstrap, topic)] == [message_id]
