"""The project's wheel, built from a copy of the source tree: a build in place reuses
``build/lib`` from earlier builds, where a migration renamed since is still present under its
old name (and Alembic then finds two heads), and two builds at once would share it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What a build does not need: environments, caches, earlier builds, history.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                    ".mypy_cache", ".ruff_cache", ".pytest_cache")


def build_wheel(folder: Path) -> Path:
    """The wheel of the working tree as it is, built in ``folder``."""
    source = folder / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
                    "--no-deps", "-w", str(folder), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = folder.glob("*.whl")
    return wheel
