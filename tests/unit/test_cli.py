"""The command line's parsing: options once on the group, clear usage errors, no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import click
import pytest
from click.testing import CliRunner, Result

from outbox.cli import _thresholds, _timestamp, main, reconcile
from outbox.entry import daemon_of
from tests.unit.test_docs import cli_commands


def outbox(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), prog_name="outbox")


@pytest.mark.parametrize("command", cli_commands())
def test_every_command_has_help(command: str) -> None:
    result = outbox(*command.split()[1:], "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {command} ")


def test_group_options_come_before_the_command() -> None:
    result = outbox("--schema", "billing", "--database-url", "postgresql://a:pw@db/x",
                    "config", "--json")
    assert result.exit_code == 0, result.output
    values = json.loads(result.output)
    assert (values["schema_name"], values["database_url"]) == ("billing",
                                                               "postgresql://a:***@db/x")
    misplaced = outbox("config", "--schema", "billing")
    assert misplaced.exit_code == 2
    assert "No such option '--schema'" in misplaced.output


def test_resume_without_ids_is_a_usage_error() -> None:
    result = outbox("--database-url", "postgresql://nowhere/x", "resume")
    assert result.exit_code == 2
    assert "give message ids, or --all" in result.output


def test_resume_with_ids_and_all_is_a_usage_error() -> None:
    """It ran as --all, then said the ids given were not resumed."""
    result = outbox("--database-url", "postgresql://nowhere/x", "resume", "3", "--all")
    assert result.exit_code == 2
    assert "give message ids or --all, not both" in result.output


def test_a_message_id_that_is_not_a_number_is_called_one() -> None:
    """Click said "'abc' is not a valid integer range"."""
    result = outbox("--database-url", "postgresql://nowhere/x", "resume", "abc")
    assert result.exit_code == 2
    assert "Invalid value for '[IDS]...': 'abc' is not a valid message id (digits 0-9)." \
        in result.output


@pytest.mark.parametrize("typed", ["1_2", "\uff11\uff12", "\u0661\u0662", " 12", "+12", "12.0"])
def test_a_message_id_is_ascii_digits_as_on_the_console(typed: str) -> None:
    """`outbox resume 1_2` (a typo) resumed message 12: click read the id with Python's
    int(), which also takes underscores, full-width and Arabic-Indic digits, blanks and a sign;
    the console refuses them."""
    result = outbox("--database-url", "postgresql://nowhere/x", "resume", typed)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '[IDS]...': {typed!r} is not a valid message id (digits 0-9)." \
        in result.output


def test_a_limit_beyond_a_bigint_is_a_usage_error() -> None:
    """PostgreSQL would refuse it as a LIMIT (bigint out of range), after connecting."""
    result = outbox("--database-url", "postgresql://nowhere/x", "discarded",
                    "--limit", "99999999999999999999")
    assert result.exit_code == 2
    assert "'--limit': 99999999999999999999 is not in the range" in result.output


def test_a_command_needing_the_database_says_how_to_name_it() -> None:
    result = outbox("db", "upgrade")
    assert result.exit_code == 2
    assert "outbox: error: database_url is not set: pass --database-url" in result.output
    assert "Traceback" not in result.output


def option(command: click.Command, name: str) -> click.Parameter:
    return next(param for param in command.params if param.name == name)


def test_times_are_iso_8601_and_utc_unless_they_say_otherwise() -> None:
    ctx, since = click.Context(reconcile), option(reconcile, "since")
    assert _timestamp(ctx, since, "2026-11-22T08:00:00") == datetime(2026, 11, 22, 8, tzinfo=UTC)
    assert _timestamp(ctx, since, "2026-11-22T08:00:00+02:00") == datetime(
        2026, 11, 22, 8, tzinfo=timezone(timedelta(hours=2)))
    assert _timestamp(ctx, since, None) is None
    bad = outbox("reconcile", "--since", "yesterday")
    assert bad.exit_code == 2
    assert "'yesterday' is not an ISO 8601 time" in bad.output


def test_thresholds_are_finding_equals_a_count_or_none() -> None:
    ctx, thresholds = click.Context(reconcile), option(reconcile, "thresholds")
    assert _thresholds(ctx, thresholds, ("discarded=3", " key_order_broken =none")) == {
        "discarded": 3, "key_order_broken": None}
    assert _thresholds(ctx, thresholds, ()) == {}
    for bad in ("discarded", "discarded=-1", "discarded=lots", "discarded=\u00b2",
                "discarded=\u0661"):  # str.isdigit takes both: int() raised, or read 1
        result = outbox("reconcile", "--threshold", bad)
        assert result.exit_code == 2, bad
        assert "use FINDING=N or FINDING=none" in result.output


@pytest.mark.parametrize(("args", "daemon"), [
    (["relay"], "relay"),
    (["sweep", "--app", "x:y"], "sweeper"),
    (["--database-url", "x", "--schema=s", "relay"], "relay"),
    (["--config", "c.toml", "sweep"], "sweeper"),
    (["reconcile", "--tables-only"], "reconciliation"),
    (["--schema", "relay", "status"], None),
    (["status"], None),
    (["--help"], None),
    ([], None),
])
def test_the_console_script_knows_a_daemon_from_its_command_line(args: list[str],
                                                                  daemon: str | None) -> None:
    """outbox.entry sets its early signal handler for the relay, the sweeper and the
    reconciliation only."""
    assert daemon_of(args) == daemon
