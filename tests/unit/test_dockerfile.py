"""The image builds from what the package installs: no folder of the namespace is left out."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from outbox.settings import ReconcileSettings

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_copies_every_folder_the_package_installs_from() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert folders == {"outbox", "relay", "spark", "migrations"}
    assert folders <= copied, f"Dockerfile does not COPY {sorted(folders - copied)}"


def test_the_reconcile_image_has_java_the_jdbc_driver_and_the_spark_extra() -> None:
    """No Docker engine runs here: the reconcile target must at least install what the local
    run needs (Java 17, the JDBC jar where the settings expect it, the spark extra)."""
    _, stage = (ROOT / "Dockerfile").read_text().split(" AS reconcile\n")
    assert "openjdk-17-jre-headless" in stage and "'.[spark]'" in stage
    assert "libpostgresql-jdbc-java" in stage
    assert ReconcileSettings().reconcile_jdbc_jar == "/usr/share/java/postgresql.jar"
