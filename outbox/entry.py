"""The ``outbox`` console script (and ``python -m outbox``): a daemon stopped while it starts.

``outbox relay`` and ``outbox sweep`` spend their first half second importing the command
line (click, psycopg, SQLAlchemy, pydantic). A SIGTERM then, before any handler of theirs was
set, killed them without a word (exit 143: an orchestrator that stopped a pod at once got no
log), a Ctrl-C printed a traceback of whatever was being imported. So this module imports
only the standard library's ``signal`` and ``sys``, sets :func:`stop_before_start` for a
daemon's command, and only then imports the command line; the daemon sets its own handler
when it runs (relay/daemon.py).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

#: The daemons' commands, and their names in the line.
DAEMONS = {"relay": "relay", "sweep": "sweeper"}
#: The group's options that take a value (outbox/cli.py): the word after one is no command.
VALUED_OPTIONS = ("--config", "--database-url", "--schema")


def stop_before_start(name: str) -> None:
    """Until the daemon takes the signals over, SIGTERM, Ctrl-C or SIGHUP ends it at once,
    exit 0, with one line: it holds nothing yet (no connection, no lease, no claim)."""
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        sys.stderr.write(f"outbox: {name} stopped before it started "
                         f"({signal.Signals(signum).name})\n")
        sys.stderr.flush()
        raise SystemExit(0)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)


def daemon_of(args: list[str]) -> str | None:
    """The name of the daemon ``args`` start (the command is the first word that is not an
    option or an option's value), or None for another command."""
    words = iter(args)
    for word in words:
        if word in VALUED_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return DAEMONS.get(word)
    return None


def main() -> Any:
    name = daemon_of(sys.argv[1:])
    if name is not None:
        stop_before_start(name)
    from outbox.cli import main as cli

    return cli()
