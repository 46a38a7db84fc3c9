"""The docs keep up with the code: every setting, CLI command, public name and metric is
documented, and the docs' relative links resolve. No database or broker needed."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from prometheus_client.metrics import MetricWrapperBase

import outbox
from outbox.cli import main
from outbox.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text()


def env_var(field: str) -> str:
    """The variable a field is read from: its validation alias, else OUTBOX_<FIELD>."""
    alias = Settings.model_fields[field].validation_alias
    return alias if isinstance(alias, str) else f"OUTBOX_{field.upper()}"


@pytest.mark.parametrize("field", sorted(Settings.model_fields))
def test_every_setting_is_in_the_configuration_reference(field: str) -> None:
    text = doc("configuration.md")
    assert f"`{env_var(field)}`" in text, f"{env_var(field)} missing from configuration.md"
    assert f"`{field}`" in text, f"TOML key {field} missing from configuration.md"


def cli_commands() -> list[str]:
    """`outbox X` for every top-level command and `outbox X Y` for those of groups."""
    found = []
    for name, command in sorted(main.commands.items()):
        found.append(f"outbox {name}")
        if isinstance(command, click.Group):
            found += [f"outbox {name} {sub}" for sub in sorted(command.commands)]
    return found


@pytest.mark.parametrize("command", cli_commands())
def test_every_cli_command_is_documented(command: str) -> None:
    text = doc("operations.md") + doc("configuration.md")
    assert command in text, f"`{command}` appears in neither operations.md nor configuration.md"


def test_the_db_and_dev_subcommands_are_covered() -> None:
    commands = cli_commands()
    for expected in ("outbox db upgrade", "outbox db downgrade", "outbox db current",
                     "outbox dev up", "outbox dev down"):
        assert expected in commands


@pytest.mark.parametrize("name", sorted(outbox.__all__))
def test_every_public_name_is_in_the_api_reference(name: str) -> None:
    assert re.search(rf"\b{re.escape(name)}\b", doc("api.md")), f"{name} missing from api.md"


def metric_names() -> list[str]:
    import outbox.relay.metrics
    import outbox.relay.sweeper

    return sorted(
        value._name
        for module in (outbox.relay.metrics, outbox.relay.sweeper)
        for value in vars(module).values()
        if isinstance(value, MetricWrapperBase)
    )


@pytest.mark.parametrize("metric", metric_names())
def test_every_metric_is_in_the_runbook(metric: str) -> None:
    assert f"`{metric}" in doc("operations.md"), f"metric {metric} missing from operations.md"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve() -> None:
    broken = []
    for page in [DOCS.parent / "README.md", DOCS.parent / "BENCHMARKS.md",
                 *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            path, anchor = target
            if re.match(r"^[a-z]+:", path):
                continue  # an external URL
            linked = (page.parent / path).resolve() if path else page
            if not linked.is_file():
                broken.append(f"{page.name}: {path}")
            elif anchor:
                anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(),
                                                       re.MULTILINE)}
                if anchor not in anchors:
                    broken.append(f"{page.name}: {path}#{anchor}")
    assert not broken, f"broken links: {broken}"


def test_every_make_target_the_docs_name_exists() -> None:
    """`make soak` was documented (README, BENCHMARKS.md) with no rule in the Makefile."""
    root = DOCS.parent
    rules = set(re.findall(r"^([a-z][\w-]*):", (root / "Makefile").read_text(), re.MULTILINE))
    pages = [root / "README.md", root / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]
    named = {(page.name, target) for page in pages
             for target in re.findall(r"`make ([a-z][\w-]*)", page.read_text())}
    assert named and not {(page, t) for page, t in named if t not in rules}


def documented_defaults() -> list[tuple[str, str, str]]:
    """(document, variable, default) of every settings table row in the README and
    configuration.md whose default cell starts with a number in backticks."""
    rows = []
    for name, text, column in (("README.md", (DOCS.parent / "README.md").read_text(), 2),
                               ("configuration.md", doc("configuration.md"), 3)):
        for line in text.splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            variable = re.fullmatch(r"`(OUTBOX_\w+)`", cells[0])
            number = re.match(r"`(\d+(?:\.\d+)?)`", cells[column]) if len(cells) > column else None
            if variable and number:
                rows.append((name, variable.group(1), number.group(1)))
    return rows


FIELD_OF = {env_var(field): field for field in Settings.model_fields}


@pytest.mark.parametrize(("document", "variable", "default"), documented_defaults())
def test_a_documented_default_is_the_settings_default(
    document: str, variable: str, default: str
) -> None:
    field = FIELD_OF[variable]
    assert float(default) == Settings.model_fields[field].default, (
        f"{document} says {variable} defaults to {default}, the code to "
        f"{Settings.model_fields[field].default}")
