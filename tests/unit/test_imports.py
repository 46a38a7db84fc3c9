"""Dependencies run one way: CLI -> daemons and jobs -> library (README, Architecture)."""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The repository's folders and the packages they install as (pyproject's package-dir).
PACKAGES = {"outbox": "outbox", "relay": "outbox.relay", "spark": "outbox.spark",
            "migrations": "outbox.migrations"}


def imported(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it, as absolute dotted names.

    ``from a import b`` counts as both ``a`` and ``a.b`` (b may be a module); imports under
    ``if __name__ == "__main__":`` count too (spark-submit runs the CLI, not a job module).
    """
    package = PACKAGES[path.parent.name]
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def reaching(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(name for name in imported(path)
                  if any(name == f or name.startswith(f"{f}.") for f in forbidden))


def loaded_by(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``statement``."""
    return json.loads(subprocess.run(
        [sys.executable, "-c",
         f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout)


def among(loaded: list[str], packages: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if any(m == p or m.startswith(f"{p}.") for p in packages)]


def test_import_outbox_loads_no_kafka_alembic_click_pyspark_or_dev_helpers() -> None:
    loaded = loaded_by("from outbox import Outbox, Settings, Status, OutboxError")
    assert "outbox.app" in loaded  # the probe imported the real package
    assert among(loaded, ("kafka", "alembic", "click", "pyspark", "outbox.dev", "outbox.relay",
                          "outbox.spark", "outbox.cli")) == []


def test_a_spark_worker_reading_a_topic_loads_none_of_the_library_it_does_not_run() -> None:
    """Every Python worker Spark starts imports the topic reader (about 0.45 s more each when
    ``import outbox`` loaded the whole library: the app, its store, psycopg, pydantic)."""
    loaded = loaded_by("import outbox.spark.kafka_source")
    assert "outbox.spark.kafka_source" in loaded
    assert among(loaded, ("outbox.app", "outbox.store", "outbox.settings", "psycopg",
                          "pydantic", "alembic", "click")) == []


def test_the_commands_and_daemons_load_alembic_only_to_migrate() -> None:
    """Alembic cost each process about 0.35 s of its 1.4 s start: every ``outbox`` command,
    relay, sweeper, console and reconciliation run imported it to compare the schema's
    revision with the code's, which needs only the revisions' ids (outbox/migrate.py)."""
    loaded = loaded_by("import outbox.cli, outbox.relay.daemon, outbox.relay.sweeper, "
                       "outbox.console.app, outbox.spark.reconcile")
    assert "outbox.relay.daemon" in loaded and "outbox.migrate" in loaded
    assert among(loaded, ("alembic", "mako")) == []


def test_the_console_script_sets_its_signal_handler_before_any_heavy_import() -> None:
    """``outbox relay`` signalled in its first half second (importing click, psycopg,
    SQLAlchemy, pydantic) died without a line: outbox.entry sets the handler first."""
    loaded = loaded_by("import outbox.entry")
    assert "outbox.entry" in loaded
    assert [m for m in loaded if m.startswith("outbox.") and m != "outbox.entry"] == []
    assert among(loaded, ("click", "psycopg", "sqlalchemy", "pydantic", "prometheus_client",
                          "kafka", "tenacity")) == []


def test_the_revisions_read_from_the_scripts_names_are_alembics() -> None:
    """:func:`outbox.migrate.revisions` reads the ids from the file names; Alembic reads the
    scripts. They must agree, one chain from the first revision to the head."""
    from outbox import migrate

    scripts = migrate.scripts()
    chain = tuple(reversed([script.revision for script in scripts.walk_revisions()]))
    assert migrate.revisions() == chain
    assert migrate.head() == scripts.get_current_head()
    for older, newer in itertools.pairwise(chain):
        assert scripts.get_revision(newer).down_revision == older, newer


def test_the_package_names_every_public_name_and_only_those() -> None:
    import outbox

    assert [getattr(outbox, name).__name__ for name in outbox.__all__] == outbox.__all__
    with pytest.raises(AttributeError, match="no attribute 'Relay'"):
        outbox.Relay  # noqa: B018


def test_type_checkers_see_the_names_the_package_imports_on_first_use() -> None:
    """outbox/__init__.py names each public name twice: for mypy (under TYPE_CHECKING) and
    for the runtime (``_HOMES``). The two lists must be the same names from the same homes."""
    import outbox

    tree = ast.parse((ROOT / "outbox" / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    typed = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported (`X as X`)"
            typed[alias.name] = node.module
    assert typed == outbox._HOMES


@pytest.mark.parametrize("path", sorted((ROOT / "spark").glob("*.py")), ids=lambda p: p.name)
def test_reconciliation_shares_no_code_with_the_relay_or_the_cli(path: Path) -> None:
    assert reaching(path, ("outbox.relay", "outbox.cli")) == []


#: outbox/*.py but the command line (cli.py, and entry.py and __main__.py that run it);
#: outbox/dev/ is not in the glob.
LIBRARY = sorted(p for p in (ROOT / "outbox").glob("*.py")
                 if p.name not in ("cli.py", "entry.py", "__main__.py"))


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.name)
def test_the_library_imports_no_daemon_job_or_cli(path: Path) -> None:
    assert reaching(path, ("outbox.relay", "outbox.spark", "outbox.cli")) == []


def test_the_scan_sees_imports_in_functions_and_relative_ones(tmp_path: Path) -> None:
    module = tmp_path / "spark" / "probe.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from outbox.relay import relay\n"
                      "from ..cli import main\nfrom outbox import relay as r\n"
                      "if __name__ == '__main__':\n    import outbox.cli\n")
    assert reaching(module, ("outbox.relay", "outbox.cli")) == [
        "outbox.cli", "outbox.cli.main", "outbox.relay", "outbox.relay.relay"]
