"""The image builds from what the package installs: no folder of the namespace is left out."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_copies_every_folder_the_package_installs_from() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert folders == {"outbox", "relay", "spark", "migrations"}
    assert folders <= copied, f"Dockerfile does not COPY {sorted(folders - copied)}"
