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

#: The commands stopped at once while they start, and their names in the line. The
#: daemons hold nothing yet and exit 0; a reconciliation that did not run exits as a shell
#: says a signal ended it (128 + the signal), as it does when stopped later: 0 would read as
#: a clean run, 1 as findings (spark/reconcile.py, stop_on_signals).
DAEMONS = {"relay": "relay", "sweep": "sweeper", "reconcile": "reconciliation"}
#: Of those, the ones whose early stop is not a success.
UNFINISHED = frozenset({"reconciliation"})
#: The group's options that take a value (outbox/cli.py): the word after one is no command.
VALUED_OPTIONS = ("--config", "--database-url", "--schema")


def stop_before_start(name: str) -> None:
    """Until the command takes the signals over, SIGTERM, Ctrl-C or SIGHUP ends it at once
    with one line: a daemon exits 0, as it holds nothing yet (no connection, no lease, no
    claim); a reconciliation 128 + the signal."""
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        unfinished = name in UNFINISHED
        sys.stderr.write(f"outbox: {name} stopped before it started "
                         f"({signal.Signals(signum).name})"
                         f"{': nothing was recorded' if unfinished else ''}\n")
        sys.stderr.flush()
        raise SystemExit(128 + signum if unfinished else 0)

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
