"""The least-privilege roles: the relay and the sweeper run under theirs, and the
application's role writes prepare rows and decisions but nothing else."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Outbox, migrate, store
from outbox.dev import services as devservices
from outbox.dev.topics import read_topic
from outbox.schema import SHARDS
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import (
    assert_refused,
    count_status,
    publish_orders,
    ranges,
    running_relay,
    wait_until,
)
from tests.processes import outbox_env, run_outbox, start_outbox


@pytest.fixture
def logins(engine: Engine, settings: Settings, schema: str) -> Iterator[dict[str, str]]:
    """A login role per group role, each with its own database URL."""
    result = run_outbox(settings, "db", "upgrade", "--create-roles")
    assert result.returncode == 0, result.stderr
    assert (f"roles {schema}_app, {schema}_relay, {schema}_sweeper, {schema}_reconcile, "
            f"{schema}_checker, {schema}_console granted" in result.stdout)
    assert "warning" not in result.stderr  # a superuser grants all
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
        for role in (f"{schema}_checker", f"{schema}_console"):
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


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


def test_application_role_cannot_forge_state_shards_headers_or_history(
    engine: Engine, outbox: Outbox, schema: str, logins: dict[str, str]
) -> None:
    """Issue 11's forgeries by the application's role, each refused by the database."""
    app_engine = create_engine(sqlalchemy_url(logins["app"]))
    try:
        with Session(app_engine) as session, session.begin():
            committed = outbox.publish(session, "t", {"n": 1})
            unknown = outbox.prepare(session, "t", {"n": 2})
            rolled_back = outbox.prepare(session, "t", {"n": 3})
        outbox.rollback(app_engine, rolled_back)  # through decide_message(), as the app
    finally:
        app_engine.dispose()
    revive = (f"INSERT INTO {schema}.pending (message_id, shard, topic, producer_group, status, "
              f"resolution, created_at) SELECT id, shard, topic, producer_group, '{{status}}', "
              f"'COMMIT', now() FROM {schema}.message WHERE id = {{id}}")
    assert_refused(logins["app"], [
        # mark a committed row delivered, park or discard it, or revive a rolled-back one
        f"UPDATE {schema}.pending SET status = 'PARKED' WHERE message_id = {committed}",
        f"DELETE FROM {schema}.pending WHERE message_id = {committed}",
        f"UPDATE {schema}.pending SET resolution = 'COMMIT' WHERE message_id = {unknown}",
        revive.format(status="PENDING", id=rolled_back),
        # write op records (a fake DELIVERED one), or rows but through publish_message()
        # (revision 0014), which chooses their creation time and state itself
        f"INSERT INTO {schema}.op_record (message_id, action, actor) "
        f"VALUES ({committed}, 'DELIVERED', 'app')",
        f"INSERT INTO {schema}.message (topic, payload, content_type, shard, created_at) "
        f"VALUES ('t', 'x', 'text/plain', 0, now() - interval '1 day')",
    ])
    assert_refused(logins["app"], [
        publish_call(schema, shard="CAST(999 AS smallint)"),  # a shard no relay owns
        publish_call(schema, header_keys="ARRAY['outbox-id']",  # a forged id header
                     header_values="ARRAY[CAST('1' AS bytea)]"),
    ], match="violates check constraint")
    assert_refused(logins["app"], [  # rows the relay and sweeper could not read (0018)
        publish_call(schema, header_keys="ARRAY['a', 'b']",
                     header_values="ARRAY[CAST('1' AS bytea)]"),
        publish_call(schema, header_keys="ARRAY['a']", header_values="ARRAY[NULL::bytea]"),
        publish_call(schema, header_keys="ARRAY[['a'], ['b']]",
                     header_values="ARRAY[['1'::bytea], ['2'::bytea]]"),
    ], match="header_keys and header_values must pair up")
    assert_refused(logins["app"], [publish_call(schema, resolution="'UNKNOWN'")],
                   match="needs check_after_seconds")
    with engine.begin() as conn:  # a DBA's shortcut: the trigger still checks such a role
        conn.execute(text(f"GRANT INSERT ON {schema}.pending TO {schema}_app_login"))
    assert_refused(logins["app"], [
        revive.format(status="PENDING", id=rolled_back),  # a rolled-back message, revived
        revive.format(status="PENDING", id=committed),  # a second pending row: pkey, or this
    ], match="written only by the publish statement|duplicate key")
    with engine.connect() as conn:
        states = dict(conn.execute(text(
            f"SELECT id, status FROM {schema}.message_state")).all())
    assert states == {committed: "PENDING", unknown: "PENDING", rolled_back: "ROLLED_BACK"}


def publish_call(schema: str, **forged: str) -> str:
    """``publish_message()`` called in SQL with a plain message's arguments, ``forged``'s
    instead where given (SQL expressions)."""
    arguments = {
        "producer_group": "'default'", "topic": "'t'", "key": "NULL", "header_keys": "NULL",
        "header_values": "NULL", "payload": "'x'", "content_type": "'text/plain'",
        "shard": "CAST(0 AS smallint)", "deliver_at": "NULL", "delay_seconds": "0",
        "resolution": "'COMMIT'",
        "check_after_seconds": "NULL", "lock_class": "0", "lock_key": "NULL",
        "notify": "false", "wake_class": "0", "wake_base": "0", "channel": "'c'",
        "delayed_note": "''", **forged}
    return (f"SELECT {schema}.publish_message("
            + ", ".join(f"{name} => {value}" for name, value in arguments.items()) + ")")


def test_relay_and_sweeper_roles_touch_only_their_own_columns(
    outbox: Outbox, engine: Engine, schema: str, logins: dict[str, str]
) -> None:
    with Session(engine) as session, session.begin():
        message_id = outbox.prepare(session, "t", {"n": 1})
    assert_refused(logins["relay"], [
        f"UPDATE {schema}.message SET payload = 'forged'",
        f"UPDATE {schema}.pending SET resolution = 'COMMIT' WHERE message_id = {message_id}",
        f"UPDATE {schema}.pending SET shard = 1",
    ])
    assert_refused(logins["sweeper"], [
        f"UPDATE {schema}.message SET payload = 'forged'",
        f"UPDATE {schema}.pending SET attempts = 0, last_error = NULL",
        f"UPDATE {schema}.pending SET shard = 1",
        f"DELETE FROM {schema}.message",
    ])


def test_a_producer_group_bound_to_a_role_is_decided_only_by_its_members(
    engine: Engine, settings: Settings, schema: str, logins: dict[str, str]
) -> None:
    payments = Outbox(settings=settings, producer_group="payments")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {schema}_payments NOLOGIN"))
        conn.execute(text(f"INSERT INTO {schema}.producer_group_role VALUES "
                          f"('payments', '{schema}_payments')"))
    app_engine = create_engine(sqlalchemy_url(logins["app"]))
    try:
        with Session(app_engine) as session, session.begin():
            bound = payments.prepare(session, "t", {"n": 1})
            free = Outbox(settings=settings).prepare(session, "t", {"n": 2})
        Outbox(settings=settings).commit(app_engine, free)  # an unbound group: any app role
        with pytest.raises(ConfigurationError,
                           match=f"only as a member of {schema}_payments\\): grant it that role"):
            payments.commit(app_engine, bound)
        with engine.begin() as conn:
            conn.execute(text(f"GRANT {schema}_payments TO {schema}_app_login"))
        payments.commit(app_engine, bound)
    finally:
        app_engine.dispose()
        with engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {schema}_payments"))
    with engine.connect() as conn:
        resolutions = dict(conn.execute(text(
            f"SELECT id, resolution FROM {schema}.message_state")).all())
    assert resolutions == {bound: "COMMIT", free: "COMMIT"}


def test_relay_role_prunes_partitions_it_does_not_own(
    engine: Engine, outbox: Outbox, small: Settings, schema: str, topic: str,
    logins: dict[str, str]
) -> None:
    publish_orders(engine, outbox, topic, [(f"k{i}", i) for i in range(12)])
    as_relay = small.model_copy(update={"database_url": logins["relay"]})
    with running_relay(as_relay):
        wait_until(lambda: count_status(engine, schema, "DELIVERED") == 12, 30, "delivered")
    with engine.begin() as conn:
        for table in ("message", "op_record"):
            conn.execute(text(f"UPDATE {schema}.{table} SET created_at = now() - interval '4 d'"))

    result = run_outbox(as_relay, "prune")
    assert result.returncode == 0, result.stderr
    assert "dropped 1 partitions older than 72 h" in result.stdout
    assert ranges(engine, schema)[0] == "message_p11"
    with engine.connect() as conn:  # tended (revision 0011) by the relay's role too
        assert conn.execute(text("SELECT reltuples FROM pg_class WHERE oid = CAST(:t AS regclass)"),
                            {"t": f"{schema}.message_p11"}).scalar_one() == 2
    assert_refused(logins["relay"], [f"SELECT FROM {schema}.op_record_p11",
                                     f"DELETE FROM {schema}.message_p11",
                                     f"DELETE FROM {schema}.message",
                                     f"DELETE FROM {schema}.op_record"])
    assert_refused(logins["relay"], [f"DROP TABLE {schema}.message_p11"], match="must be owner")


def readable_by_relay(engine: Engine, schema: str) -> dict[str, bool]:
    """Each partition of `message` and `op_record`: may the relay's role read it directly?"""
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT c.relname, has_table_privilege(:role, c.oid, 'SELECT') "
            "FROM pg_inherits AS h JOIN pg_class AS c ON c.oid = h.inhrelid "
            "WHERE h.inhparent IN (CAST(:m AS regclass), CAST(:o AS regclass))"),
            {"role": f"{schema}_relay", "m": f"{schema}.message",
             "o": f"{schema}.op_record"}).all())


def test_relay_role_reads_each_range_of_message_directly(
    engine: Engine, outbox: Outbox, small: Settings, schema: str, topic: str,
    logins: dict[str, str]
) -> None:
    """The relay reads a batch's messages from their range (revision 0015): its role may read
    every range of `message` there was when the roles were granted and every range made
    since, and nothing else of the partitions."""
    granted = ranges(engine, schema)
    with engine.begin() as conn:  # one more range, past those `db upgrade` made
        assert store.ensure_partitions(conn, schema, 1_000_000, ahead=3) == 1
    made = set(ranges(engine, schema)) - set(granted)
    assert len(granted) >= 3 and len(made) == 1
    readable = readable_by_relay(engine, schema)
    assert {name for name, may in readable.items() if may} == set(granted) | made
    assert len(readable) == 2 * (len(granted) + 1) + 2  # op_record's ranges, both defaults
    publish_orders(engine, outbox, topic, [(f"k{i}", i) for i in range(5)])
    as_relay = store.engine(sqlalchemy_url(logins["relay"]), settings=store.FETCHING_SETTINGS)
    try:
        with as_relay.connect() as conn:
            reading = store.Fetching(conn, schema)
            batch = store.fetch_deliverable(conn, schema, range(SHARDS), 10, fetching=reading)
            assert reading.direct and reading.range_of(batch[0].id, batch[-1].id) == "message_p1"
    finally:
        as_relay.dispose()
    assert len(batch) == 5


ROLE_KINDS = ("app", "relay", "sweeper", "reconcile", "checker", "console")


def test_roles_made_by_an_owner_who_may_not_grant_activity_say_what_a_superuser_must_run(
    engine: Engine, services: devservices.Services
) -> None:
    """PostgreSQL's own warning (``RAISE WARNING`` in the block) reached no one, and the
    command said every role was granted; ``outbox reconcile`` then refused to run."""
    name = f"r_{uuid.uuid4().hex[:12]}"
    owner = f"{name}_owner"
    with engine.begin() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        conn.execute(text(f"CREATE ROLE {owner} LOGIN PASSWORD 'pw'"))
        conn.execute(text(f"GRANT CREATE ON DATABASE {database} TO {owner}"))
        for kind in ROLE_KINDS:  # made by a superuser; the owner may grant but not make them
            conn.execute(text(f"CREATE ROLE {name}_{kind} NOLOGIN"))
            conn.execute(text(f"GRANT {name}_{kind} TO {owner} WITH ADMIN OPTION"))
    url = services.database_url.replace(f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@",
                                        f"{owner}:pw@")
    try:
        result = run_outbox(None, "db", "upgrade", "--create-roles", env={
            **os.environ, "OUTBOX_DATABASE_URL": url, "OUTBOX_SCHEMA": name})
        assert result.returncode == 0, result.stderr
        assert (f"outbox: warning: this role may not grant what {name}_reconcile needs"
                in result.stderr)
        assert f"a superuser must run: GRANT pg_read_all_stats TO {name}_reconcile" \
            in result.stderr
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
            for role in [*(f"{name}_{kind}" for kind in ROLE_KINDS), owner]:
                conn.execute(text(f"DROP OWNED BY {role}"))
                conn.execute(text(f"DROP ROLE {role}"))


def test_roles_asked_of_a_login_that_may_not_create_roles_say_the_schema_is_migrated(
    engine: Engine, services: devservices.Services
) -> None:
    """The schema's owner without CREATEROLE: the upgrade succeeded, then the line said 'this
    login may not migrate schema ...: run `outbox db` as the role that owns the schema, or one
    with CREATE on the database', which this login is."""
    name = f"r_{uuid.uuid4().hex[:12]}"
    owner = f"{name}_owner"
    with engine.begin() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        conn.execute(text(f"CREATE ROLE {owner} LOGIN PASSWORD 'pw'"))
        conn.execute(text(f"GRANT CREATE ON DATABASE {database} TO {owner}"))
    url = services.database_url.replace(f"{devservices.DB_USER}:{devservices.DB_PASSWORD}@",
                                        f"{owner}:pw@")
    try:
        result = run_outbox(None, "db", "upgrade", "--create-roles", env={
            **os.environ, "OUTBOX_DATABASE_URL": url, "OUTBOX_SCHEMA": name})
        assert (result.returncode, result.stderr) == (2, (
            f"outbox: error: schema {name} is migrated, but this login may not create its "
            f"roles (permission denied to create role): run `outbox --schema {name} db "
            "upgrade --create-roles` as a superuser or a role with CREATEROLE "
            "(docs/operations.md, \"Least-privilege roles\")\n"))
        assert result.stdout == f"schema {name} is at revision {migrate.head()}\n"
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
            conn.execute(text(f"DROP OWNED BY {owner}"))
            conn.execute(text(f"DROP ROLE {owner}"))
