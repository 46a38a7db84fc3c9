"""The least-privilege roles: the relay and the sweeper run under theirs, and the
application's role writes prepare rows and decisions but nothing else."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import assert_refused, count_status, running_relay, wait_until
from tests.processes import outbox_env, run_outbox, start_outbox


@pytest.fixture
def logins(engine: Engine, settings: Settings, schema: str) -> Iterator[dict[str, str]]:
    """A login role per group role, each with its own database URL."""
    result = run_outbox(settings, "db", "upgrade", "--create-roles")
    assert result.returncode == 0, result.stderr
    assert (f"roles {schema}_app, {schema}_relay, {schema}_sweeper, {schema}_reconcile, "
            f"{schema}_checker granted" in result.stdout)
    urls = {}
    with engine.begin() as conn:
        for kind in ("app", "relay", "sweeper"):
            login = f"{schema}_{kind}_login"
            conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'pw' IN ROLE {schema}_{kind}"))
            urls[kind] = settings.database_url.replace(
                f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@", f"{login}:pw@")
    yield urls
    with engine.begin() as conn:
        for kind in ("app", "relay", "sweeper"):
            for role in (f"{schema}_{kind}_login", f"{schema}_{kind}"):
                conn.execute(text(f"DROP OWNED BY {role}"))
                conn.execute(text(f"DROP ROLE {role}"))
        conn.execute(text(f"DROP OWNED BY {schema}_checker"))
        conn.execute(text(f"DROP ROLE {schema}_checker"))


def test_relay_and_sweeper_work_under_their_roles(
    engine: Engine, settings: Settings, schema: str, topic: str, logins: dict[str, str]
) -> None:
    app_engine = create_engine(sqlalchemy_url(logins["app"]))
    outbox = Outbox(settings=settings)
    try:
        with Session(app_engine) as session, session.begin():
            committed = outbox.publish(session, topic, {"n": 1}, key="k")
            prepared = outbox.prepare(session, topic, {"n": 2}, key="other")
            left_unknown = outbox.prepare(session, topic, {"n": 3}, key="third",
                                          check_immunity=timedelta(0))
        outbox.commit(app_engine, prepared)
    finally:
        app_engine.dispose()
    as_relay = settings.model_copy(update={"database_url": logins["relay"]})
    sweeper = start_outbox(settings, "sweep", **{
        **{k: v for k, v in outbox_env(settings).items() if k.startswith("OUTBOX_")},
        "OUTBOX_DATABASE_URL": logins["sweeper"], "OUTBOX_TRANSACTION_TIMEOUT": "0.1",
        "OUTBOX_CHECK_INTERVAL": "0.2",
        "OUTBOX_SQL_CHECKERS": '{"default": "SELECT \'COMMIT\'"}'})
    try:
        with running_relay(as_relay):
            wait_until(lambda: count_status(engine, schema, "DELIVERED") == 3, 30,
                       "all three delivered by the relay's and the sweeper's roles")
    finally:
        sweeper.send_signal(signal.SIGTERM)
        output, _ = sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, output
    delivered = {r.message_id for r in read_topic(settings.kafka_bootstrap, topic)}
    assert delivered == {committed, prepared, left_unknown}


def test_application_role_cannot_read_payloads_or_forge_deliveries(
    engine: Engine, outbox: Outbox, schema: str, logins: dict[str, str]
) -> None:
    app_engine = create_engine(sqlalchemy_url(logins["app"]))
    try:
        with Session(app_engine) as session, session.begin():
            message_id = outbox.publish(session, "t", {"secret": True})
    finally:
        app_engine.dispose()
    assert message_id > 0
    assert_refused(logins["app"], [
        f"SELECT payload FROM {schema}.message",
        f"UPDATE {schema}.message SET payload = 'x'",
        f"DELETE FROM {schema}.message",
        f"UPDATE {schema}.relay_lease SET owner = 'me'",
        f"SELECT * FROM {schema}.op_record",
    ])
