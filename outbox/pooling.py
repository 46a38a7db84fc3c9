"""Whether a database URL gives each client a server session of its own.

The relay, the sweeper and the CLI keep state in their sessions: advisory locks (a relay's
worker id, its wake locks), ``LISTEN``, prepared statements, settings. Behind a pooler in
transaction mode (PgBouncer's ``pool_mode = transaction``) each transaction may run on
another client's server session: a relay's wake locks stayed on sessions it no longer had,
it hung for good with its shards leased, a restarted one was refused as its own twin, and
the CLI's settings reached applications' transactions. :func:`refuse_transaction_pooling`
finds such a pooler before any of that, in a few milliseconds at start: the CLI for every
command, and :class:`~outbox.relay.relay.Relay` and :class:`~outbox.relay.sweeper.Sweeper`
when they run (a process looks once per URL).
"""

from __future__ import annotations

import select
import time
from typing import Any

import psycopg
from psycopg import pq

from outbox import store
from outbox.exceptions import ConfigurationError
from outbox.settings import mask_url

#: How long the probe waits for a server session that another of its connections may hold.
PROBE_SECONDS = 2.0
_PID = b"SELECT pg_catalog.pg_backend_pid()"
#: The URLs this process found to give each connection a session of its own.
_OWN_SESSIONS: set[str] = set()


def refuse_transaction_pooling(url: str, who: str) -> None:
    """Raise :class:`ConfigurationError` when ``url`` (a SQLAlchemy URL) leads to a pooler
    that hands a client's transactions to server sessions it does not keep; ``who`` names
    the process in the message.

    Straight to PostgreSQL, a connection's backend pid is the one it was told at login, and
    nothing more is asked. Through a pooler it is not, so two connections look further: A
    runs a statement, then B opens a transaction. In session mode A keeps its server
    session, so B gets another and A answers from its own at once. In transaction mode A's
    session went back to the pool after its statement: B's transaction takes it (pools hand
    back the last one returned), and A then answers from another session, or waits for one.
    When the pool has no session for B either, or a statement fails, nothing is concluded,
    and the next call looks again. When A cannot connect, its error is raised: the command
    would only wait as long again to be told the same (``psycopg.OperationalError``)."""
    if url in _OWN_SESSIONS:
        return
    with store.connect(url, autocommit=True, prepare_threshold=None) as a:
        try:
            own = _own_sessions(url, a)
        except psycopg.Error:
            return
    if own:
        _OWN_SESSIONS.add(url)
    elif own is False:
        raise ConfigurationError(
            f"{who} needs PostgreSQL sessions of its own, and {mask_url(url)} gives each "
            "transaction whichever server session is free (a pooler in transaction mode, "
            "such as PgBouncer's pool_mode = transaction): point it at PostgreSQL, or at a "
            "pool in session mode (docs/operations.md, \"Connection poolers\")")


def _own_sessions(url: str, a: psycopg.Connection[Any]) -> bool | None:
    """Whether each connection to ``url`` keeps a server session; None when B got none."""
    first = _pid(a.execute(_PID).fetchone())
    if a.info.backend_pid == first:
        return True  # no pooler between
    with store.connect(url, autocommit=True, prepare_threshold=None) as b:
        held = _answer_within(b.pgconn, b"BEGIN; " + _PID, PROBE_SECONDS)
        if held is None:
            return None  # no server session to spare
        return held != first and _answer_within(a.pgconn, _PID, PROBE_SECONDS) == first


def _pid(row: Any) -> int:
    return int(row[0])


def _answer_within(pgconn: pq.abc.PGconn, query: bytes, seconds: float) -> int | None:
    """The backend pid ``query`` (its last statement) answers on ``pgconn``, or None when no
    answer came within ``seconds`` (the caller then closes the connection)."""
    pgconn.send_query(query)
    deadline = time.monotonic() + seconds
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            break
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        select.select([pgconn.socket], [], [], left)
    pid = None
    while (result := pgconn.get_result()) is not None:
        if result.status == pq.ExecStatus.TUPLES_OK:
            pid = int(result.get_value(0, 0) or b"0")
        elif result.status != pq.ExecStatus.COMMAND_OK:
            raise psycopg.OperationalError(
                (result.error_message or b"").decode(errors="replace").strip())
    return pid
