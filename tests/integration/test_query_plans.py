"""Plans of the relay's hot statements: they read what their batch needs, however the
tables grow and however often they run."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, NullPool, text
from sqlalchemy.orm import Session

from outbox import Outbox, store
from outbox.dev import services as devservices
from outbox.relay.relay import Recorder, Relay
from outbox.schema import SHARDS
from outbox.settings import Settings, sqlalchemy_url
from tests.conftest import ranges, use_ranges
from tests.plans import explained, explained_prepared, queue, rows_read


def test_the_fetch_reads_its_batch_not_the_retained_history(
        engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Joined as a set, the relay's fetch merge-joined `pending` with every partition of
    `message`, walking all retained history below the first pending id: 0.4 s a batch at
    300,000 delivered rows, and the relay fell behind under load. It must read by key."""
    use_ranges(engine, schema, 300, ahead=12)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x" * 200, key=f"k{i % 50}") for i in range(3000)]
    with engine.begin() as conn:
        store.mark_delivered(conn, schema, "test", [(i, 0, n) for n, i in enumerate(ids[:2900])])
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    with engine.connect() as conn:
        batch = store.fetch_deliverable(conn, schema, range(SHARDS), 2000)
    assert [row.id for row in batch] == ids[2900:]
    picked = explained(engine, schema, "fetch_deliverable", {
        "shards": store.int_array(range(SHARDS)), "limit": 2000, "in_flight": store.id_ranges(()),
        "held": []})
    assert rows_read(picked, "pending") <= 2 * 100, picked
    plan = explained(engine, schema, "read_deliverable", {
        "ids": store.int_array(ids[2900:]), "low": ids[2900], "high": ids[-1],
        "max_bytes": 1 << 24})
    assert len(ranges(engine, schema)) >= 11
    assert rows_read(plan) <= 300, plan  # at most the range of 300 ids the batch is in


def partitions_planned(plan: dict[str, Any], table: str = "message") -> set[str]:
    """The partitions of ``table`` a plan holds a node for (each planned, locked, started)."""
    own = {plan["Relation Name"]} if str(plan.get("Relation Name", "")).startswith(
        f"{table}_") else set()
    return own.union(*(partitions_planned(child, table) for child in plan.get("Plans", [])))


def test_the_fetch_plans_the_partitions_of_its_batch_not_of_the_retained_history(
        engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Looked up row by row, the messages of a batch were read through a plan of every
    partition of `message`: at 257 partitions (72 h of 1,000 msg/s) a fetch of 4 rows spent
    6 ms planning and 7.6 ms in all, against 0.6 ms at 5 partitions."""
    use_ranges(engine, schema, 100, ahead=40)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x", key=f"k{i % 5}") for i in range(3900)]
    with engine.begin() as conn:
        store.mark_delivered(conn, schema, "test", [(i, 0, n) for n, i in enumerate(ids[:3850])])
        batch = store.fetch_deliverable(conn, schema, range(SHARDS), 2000)
    assert [row.id for row in batch] == ids[3850:]
    plan = explained(engine, schema, "read_deliverable", {
        "ids": store.int_array(ids[3850:]), "low": ids[3850], "high": ids[-1],
        "max_bytes": 1 << 24})
    assert len(ranges(engine, schema)) >= 40
    assert partitions_planned(plan) == {"message_p3801"}, plan


def stale_queue(engine: Engine, schema: str, topic: str) -> list[int]:
    """A queue's statistics are a snapshot: `pending` analyzed while nearly empty (20 rows),
    then filled again with 30,000 in the space its vacuum freed, looks to the planner like a
    few rows. Returns the ids of the 30,000."""
    with engine.begin() as conn:  # no autovacuum: the statistics stay the snapshot below
        conn.execute(text(f"ALTER TABLE {schema}.pending SET (autovacuum_enabled = false)"))
    queue(engine, schema, topic, 30_000)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"DELETE FROM {schema}.pending WHERE message_id <= "
                          f"(SELECT max(message_id) - 20 FROM {schema}.pending)"))  # delivered
        conn.execute(text(f"VACUUM ANALYZE {schema}.pending"))
    return queue(engine, schema, topic, 30_000)


def test_the_fetch_reads_its_batch_whatever_the_statistics_say_of_the_backlog(
        services: devservices.Services, engine: Engine, schema: str, topic: str) -> None:
    """Planned on the snapshot, the fetch merge-anti-joined the whole backlog with the rows
    holding keys back and sorted it, for every batch: 54 ms instead of 10 for 2,000 rows of a
    50,000-message backlog. Under load the relay fell behind, and the longer the backlog the
    slower each batch."""
    stale_queue(engine, schema, topic)
    params = {"shards": store.int_array(range(SHARDS)), "limit": 100,
              "in_flight": store.id_ranges(()), "held": [], "max_bytes": 1 << 24}
    assert rows_read(explained(engine, schema, "fetch_deliverable", params), "pending") \
        > 30_000, "the planner no longer takes this snapshot for a few rows: a weaker test"
    relays = store.engine(sqlalchemy_url(services.database_url),
                          settings=store.DELIVERY_SETTINGS, poolclass=NullPool)
    try:
        plan = explained(relays, schema, "fetch_deliverable", params)
        promote = explained(relays, schema, "promote_due",
                            {"shards": store.int_array(range(SHARDS))})
    finally:
        relays.dispose()
    assert rows_read(plan, "pending") <= 2 * 100, plan
    assert rows_read(promote, "pending") == 0, promote  # none is DELAYED


def test_the_fetch_planned_once_walks_to_its_limit_whatever_the_statistics_say(
        services: devservices.Services, engine: Engine, schema: str, topic: str) -> None:
    """The relay plans the fetch once, for no parameters in particular
    (store.FETCHING_SETTINGS): on the same snapshot that plan must still walk the queue's
    index to its LIMIT, past the rows in flight (a backlog's three batches of 2,000), and
    never sort the backlog."""
    queued = stale_queue(engine, schema, topic)
    in_flight = store.IdRanges.joined(
        store.IdRanges.of(queued[start:start + 2000]) for start in (0, 2000, 4000))
    params = {"shards": store.int_array(range(SHARDS)), "limit": 2000,
              "in_flight": in_flight.literal, "held": []}
    fetching = store.engine(sqlalchemy_url(services.database_url),
                            settings=store.FETCHING_SETTINGS, poolclass=NullPool)
    try:
        plan, generic = explained_prepared(fetching, schema, "fetch_deliverable", params)
    finally:
        fetching.dispose()
    assert generic
    assert rows_read(plan, "pending") <= 2 * 2000 + in_flight.size < len(queued), plan


@pytest.mark.parametrize("holding", ["held", "delayed"])
def test_the_fetch_probes_the_rows_holding_keys_back_whatever_the_statistics_say(
        services: devservices.Services, engine: Engine, schema: str, topic: str,
        holding: str) -> None:
    """Analyzed with no row holding a key back, then 20,000 such rows (a held topic's,
    flagged, or delayed ones): the planner took them for one row and, once per batch, read
    them all into memory to compare each fetched row with each of them. 6.2 s for a batch
    of 500 over 100,000 held rows (bench/held_fetch_bench.py; 10.5 s under EXPLAIN
    ANALYZE), where probing the key-hold index per row took 2 ms. The relay's plans, custom
    and generic, must probe."""
    with engine.begin() as conn:  # no autovacuum: the statistics stay the snapshot below
        conn.execute(text(f"ALTER TABLE {schema}.pending SET (autovacuum_enabled = false)"))
    queue(engine, schema, topic, 20)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {schema}.pending"))
    other = f"{topic}-{holding}"
    queue(engine, schema, other, 20_000)
    with engine.begin() as conn:
        if holding == "held":
            store.mark_held(conn, schema, {other: "held: by the test"}, range(SHARDS),
                            limit=20_000)
        else:
            conn.execute(text(f"UPDATE {schema}.pending SET status = 'DELAYED', "
                              f"deliver_after = now() + interval '1 hour' WHERE topic = :t"),
                         {"t": other})
        holders = conn.execute(text(
            f"SELECT count(*) FROM {schema}.pending WHERE key IS NOT NULL AND "
            f"(status = 'DELAYED' OR held)")).scalar_one()
    assert holders == 20_000
    queue(engine, schema, topic, 1_000)
    params = {"shards": store.int_array(range(SHARDS)), "limit": 500,
              "in_flight": store.id_ranges(()), "held": [other] if holding == "held" else []}
    for settings in (store.DELIVERY_SETTINGS, store.FETCHING_SETTINGS):
        relays = store.engine(sqlalchemy_url(services.database_url), settings=settings,
                              poolclass=NullPool)
        try:
            plan, _ = explained_prepared(relays, schema, "fetch_deliverable", params)
        finally:
            relays.dispose()
        assert rows_read(plan, "pending") <= 2 * 520, (settings, plan)


def recording(acked: list[int]) -> dict[str, dict[str, Any]]:
    """The recorder's two statements, by name, with the parameters that close ``acked``."""
    return {
        "mark_delivered": {"ids": store.int_array(acked), "actor": "test",
                           "partitions": store.int_array([0] * len(acked)),
                           "offsets": store.int_array(acked)},
        "record_failures": {"ids": store.int_array(acked), "errors": ["no"] * len(acked),
                            "permanent": [True] * len(acked), "actor": "test",
                            "max_attempts": 3}}


def assert_the_recorder_reads_only(services: devservices.Services, schema: str,
                                   statements: dict[str, dict[str, Any]], rows: int) -> None:
    """The recorder's session plans each statement once, for no parameters in particular
    (a generic plan): each plan must still read at most ``rows`` pending rows."""
    recorders = store.engine(sqlalchemy_url(services.database_url),
                             settings=store.RECORDING_SETTINGS, poolclass=NullPool)
    try:
        for name, params in statements.items():
            plan, generic = explained_prepared(recorders, schema, name, params)
            assert generic, name
            assert rows_read(plan, "pending") <= rows, (name, plan)
    finally:
        recorders.dispose()


def test_recording_a_batch_reads_its_rows_whatever_the_statistics_say_of_the_backlog(
        services: devservices.Services, engine: Engine, schema: str, topic: str) -> None:
    """On the same snapshot, the recorder's statements scanned every pending row to close a
    batch's (a hashed `= ANY`): the longer the backlog, the slower each batch. The recorder
    plans them once (generic plans): those must read by key too."""
    acked = stale_queue(engine, schema, topic)[:2000]
    statements = recording(acked)
    assert rows_read(explained(engine, schema, "mark_delivered",
                               statements["mark_delivered"]), "pending") > 30_000, \
        "the planner no longer takes this snapshot for a few rows: a weaker test"
    assert_the_recorder_reads_only(services, schema, statements, len(acked))


def test_the_sweeper_reads_its_due_rows_whatever_the_statistics_say_of_the_backlog(
        engine: Engine, schema: str, topic: str) -> None:
    """The sweeper keeps the default settings: on the same snapshot its statements must still
    find the few UNKNOWN rows among the relay's backlog through pending_check_idx."""
    unknown = stale_queue(engine, schema, topic)[:50]
    with engine.begin() as conn:  # 50 UNKNOWN rows due for a check-back, among 30,020
        conn.execute(text(f"UPDATE {schema}.pending SET resolution = 'UNKNOWN', "
                          f"next_check_at = now() - interval '1 second' "
                          f"WHERE message_id = ANY(:ids)"), {"ids": unknown})
    statements = {
        "claim_checks": {"groups": ["default"], "limit": 10, "claim_seconds": 30},
        "next_check_in": {"groups": ["default"]},
        "unchecked_groups": {"groups": ["other"]},
        "record_checks": {"ids": store.int_array(unknown[:10]), "tokens": ["2026-01-01"] * 10,
                          "resolutions": ["UNKNOWN"] * 10, "details": ["?"] * 10,
                          "check_max": 15, "check_interval": 60, "counted": 1, "actor": "test",
                          "channel": "test"}}
    for name, params in statements.items():
        plan = explained(engine, schema, name, params)
        # record_checks reads its 10 rows to lock them (SKIP LOCKED), then, planned on the
        # snapshot, the 50 due ones twice (its UPDATE and DELETE): 110 of 30,020
        assert rows_read(plan, "pending") <= 3 * len(unknown), (name, plan)


def test_the_outbox_processes_run_without_jit_and_with_custom_plans(
        services: devservices.Services) -> None:
    """Their lookups into partitioned tables are priced past ``jit_above_cost``: the fetch
    above compiled for 1.3 s over 43 partitions to run for 9 ms."""
    made = store.engine(sqlalchemy_url(services.database_url))
    try:
        with made.connect() as conn:
            assert conn.execute(text("SHOW jit")).scalar_one() == "off"
            assert conn.execute(text("SHOW plan_cache_mode")).scalar_one() == "force_custom_plan"
    finally:
        made.dispose()


def test_the_relay_plans_its_hot_statements_for_a_queue(settings: Settings) -> None:
    """Its delivery, fetching and recording connections carry the settings the tests above
    use."""
    relay = Relay(settings)
    recorder = Recorder(settings, lambda _: None, lambda *_: None)
    try:
        with relay._engine.connect() as delivery, recorder.engine.connect() as recording, \
                relay._fetching_engine.connect() as fetching:
            assert delivery.execute(text("SHOW enable_sort")).scalar_one() == "off"
            assert delivery.execute(text("SHOW plan_cache_mode")).scalar_one() == \
                "force_custom_plan"
            assert fetching.execute(text("SHOW enable_sort")).scalar_one() == "off"
            assert fetching.execute(text("SHOW plan_cache_mode")).scalar_one() == \
                "force_generic_plan"
            assert recording.execute(text("SHOW enable_seqscan")).scalar_one() == "off"
            assert recording.execute(text("SHOW plan_cache_mode")).scalar_one() == \
                "force_generic_plan"
    finally:
        relay._engine.dispose()
        relay._fetching_engine.dispose()
        recorder.engine.dispose()


def test_the_fetch_is_planned_for_its_parameters_however_often_it_runs(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """psycopg prepares a statement on its fifth run; five runs later PostgreSQL chose a
    generic plan for the fetch, which compared every pending row with every id in flight
    (1.5 s a batch at a 50,000-message backlog): the relay fell from 20k msg/s to 2k."""
    with Session(engine) as session, session.begin():
        for i in range(400):
            outbox.publish(session, topic, b"x", key=f"k{i % 50}")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    made = store.engine(sqlalchemy_url(services.database_url), poolclass=NullPool)
    try:
        with made.connect() as conn:
            in_flight: list[int] = []
            for _ in range(20):
                batch = store.fetch_deliverable(conn, schema, range(SHARDS), 10,
                                                in_flight=store.IdRanges.of(in_flight))
                assert batch, "the backlog lasts all 20 fetches"
                in_flight += [row.id for row in batch]
            plans = conn.execute(text(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE :fetch"), {"fetch": f"%FROM {schema}.pending AS p%"}).all()
    finally:
        made.dispose()
    assert len(plans) == 1, plans
    assert plans[0].generic_plans == 0 and plans[0].custom_plans >= 10, plans[0]


def fetch_plans(conn: Any, schema: str) -> Any:
    """Generic and custom plans of the fetches prepared on ``conn``: the ids alone
    (``fetch_deliverable``) and with their messages (``fetch_batch``), together."""
    return conn.execute(text(
        "SELECT coalesce(sum(generic_plans), 0) AS generic_plans, "
        "coalesce(sum(custom_plans), 0) AS custom_plans FROM pg_prepared_statements "
        "WHERE statement LIKE :fetch"), {"fetch": f"%FROM {schema}.pending AS p%"}).one()


def test_the_fetch_is_planned_once_however_many_rows_are_in_flight(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """A trickle's fetches (2-3 rows) were planned for every batch, most of the relay's
    database time: the fetch runs on the relay's fetching connection, which plans it once.
    Until the ids in flight went as ranges, a backlog's fetches (more than 64 in flight) went
    back to the connection that plans for its parameters, 1.8 µs a message more of the
    fetch ("The fetch planned once under a backlog, session 29")."""
    with Session(engine) as session, session.begin():
        published = [outbox.publish(session, topic, b"x", key=f"k{i % 50}") for i in range(400)]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    url = sqlalchemy_url(services.database_url)
    delivery = store.engine(url, settings=store.DELIVERY_SETTINGS, poolclass=NullPool)
    fetching = store.engine(url, settings=store.FETCHING_SETTINGS, poolclass=NullPool)
    try:
        with delivery.connect() as conn, fetching.connect() as planned_once:
            in_flight: list[int] = []
            reading = store.Fetching(planned_once, schema)
            while len(in_flight) < 200:
                batch = store.fetch_deliverable(conn, schema, range(SHARDS), 5,
                                                in_flight=store.IdRanges.of(in_flight),
                                                fetching=reading)
                assert len(batch) == 5, "the backlog lasts every fetch"
                in_flight += [row.id for row in batch]
            once, per_call = fetch_plans(planned_once, schema), fetch_plans(conn, schema)
    finally:
        delivery.dispose()
        fetching.dispose()
    assert in_flight == published[:200]  # in order, none twice, none skipped
    # 40 fetches with 0-195 ids in flight (psycopg prepares a statement on its 5th run)
    assert once.generic_plans >= 34 and once.custom_plans == 0, once
    assert (per_call.generic_plans, per_call.custom_plans) == (0, 0), per_call


def range_plans(conn: Any, schema: str, *, fetched: bool = False
                ) -> dict[str, tuple[int, int]]:
    """Generic and custom plans of the reads of messages prepared on ``conn``, by the table
    read: the reads of ids fetched before (``read_deliverable``), or with ``fetched`` the
    fetches that read them in the same statement (``fetch_batch``)."""
    found = conn.execute(text(
        "SELECT substring(statement FROM :table), generic_plans, custom_plans "
        "FROM pg_prepared_statements WHERE statement LIKE '%sum(octet_length(m.payload))%' "
        "AND (statement LIKE :fetch) = :fetched"),
        {"table": rf"FROM {schema}\.(\w+) AS m", "fetch": f"%FROM {schema}.pending AS p%",
         "fetched": fetched}).all()
    return {table: (generic, custom) for table, generic, custom in found}


def test_a_batch_in_one_range_is_read_from_it_planned_once(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """Through `message`, a batch's messages were planned for every batch, and a plan made
    once would lock every range of retained history. A batch inside one range is read from
    that range, planned once (after the first, in the statement that fetches its ids); one
    across two ranges, or past every range known, through `message`. All read the same
    rows."""
    use_ranges(engine, schema, 100, ahead=4)
    with Session(engine) as session, session.begin():
        published = [outbox.publish(session, topic, f"m{i}".encode(), key=f"k{i % 50}")
                     for i in range(300)]
    names = ranges(engine, schema)
    url = sqlalchemy_url(services.database_url)
    delivery = store.engine(url, settings=store.DELIVERY_SETTINGS, poolclass=NullPool)
    fetching = store.engine(url, settings=store.FETCHING_SETTINGS, poolclass=NullPool)
    try:
        with delivery.connect() as conn, fetching.connect() as planned_once:
            reading = store.Fetching(planned_once, schema)
            fetched: list[store.Deliverable] = []
            while batch := store.fetch_deliverable(conn, schema, range(SHARDS), 7,
                                                   fetching=reading):
                fetched += batch  # and delivered: no ids in flight, as under a trickle
                with conn.begin():
                    store.mark_delivered(conn, schema, "test", [(r.id, 0, r.id) for r in batch])
            once = range_plans(planned_once, schema, fetched=True)
            across = reading.range_of(published[99], published[100])
            beyond = reading.range_of(published[-1], published[-1] + 400)
    finally:
        delivery.dispose()
        fetching.dispose()
    assert [(r.id, r.payload) for r in fetched] == [
        (i, f"m{n}".encode()) for n, i in enumerate(published)]
    assert set(once) == set(names[:3]), once  # each range of 100 ids read by itself ...
    assert all(generic >= 5 and custom == 0 for generic, custom in once.values()), once
    assert across is None and beyond is None  # ... and never two in one statement


def prepared(conn: Any) -> list[tuple[str, int, int]]:
    """The statements prepared on ``conn``, with their generic and custom plans."""
    return [tuple(row) for row in conn.execute(text(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"))]


def test_under_a_trickle_each_batch_is_fetched_in_one_statement(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """The ids, then their messages, were two statements a batch: two round trips, each a
    wake-up of the relay and of its server on busy cores. Once a batch was read from a
    range, the next ones are fetched with their messages from that range in one statement,
    planned once; nothing runs on the delivery connection."""
    use_ranges(engine, schema, 100, ahead=2)
    url = sqlalchemy_url(services.database_url)
    delivery = store.engine(url, settings=store.DELIVERY_SETTINGS, poolclass=NullPool)
    fetching = store.engine(url, settings=store.FETCHING_SETTINGS, poolclass=NullPool)
    published: list[int] = []
    fetched: list[store.Deliverable] = []
    try:
        with delivery.connect() as conn, fetching.connect() as planned_once:
            reading = store.Fetching(planned_once, schema)
            for n in range(12):
                with Session(engine) as session, session.begin():
                    published.append(outbox.publish(session, topic, f"m{n}".encode(), key="k"))
                fetched += store.fetch_deliverable(conn, schema, range(SHARDS), 10,
                                                   in_flight=store.IdRanges.of(
                                                       [r.id for r in fetched]),
                                                   fetching=reading)
            once, per_call = prepared(planned_once), prepared(conn)
    finally:
        delivery.dispose()
        fetching.dispose()
    assert [(r.id, r.payload) for r in fetched] == [
        (i, f"m{n}".encode()) for n, i in enumerate(published)]
    # the first batch's two steps ran once each (a statement is prepared on its fifth run)
    assert len(once) == 1, once
    statement, generic, custom = once[0]
    assert f"FROM {schema}.pending AS p" in statement and "LEFT JOIN LATERAL" in statement
    assert generic >= 5 and custom == 0, once
    assert per_call == [], per_call


def locked_partitions(url: str, schema: str, statement: str, params: dict[str, Any]
                      ) -> set[str]:
    """The partitions of `message` a transaction holds locks on after running ``statement``
    ten times on a connection that plans it once (prepared from the fifth run)."""
    made = store.engine(sqlalchemy_url(url), settings=store.FETCHING_SETTINGS,
                        poolclass=NullPool)
    try:
        with made.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver is not None
            for _ in range(10):
                driver.execute(statement, params)
            return set(conn.execute(text(
                "SELECT c.relname FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation "
                "WHERE l.pid = pg_backend_pid() AND c.relkind = 'r' "
                "AND c.relnamespace = CAST(:schema AS regnamespace) "
                "AND c.relname LIKE 'message%'"), {"schema": schema}).scalars())
    finally:
        made.dispose()


def test_a_batch_read_from_its_range_locks_that_range_alone(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """Planned once, the read through `message` locks every range of retained history each
    time it runs (PostgreSQL 15 locks every partition a generic plan holds); read from the
    batch's range, it locks that one, and so does the fetch that reads it with the ids."""
    use_ranges(engine, schema, 100, ahead=6)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x", key="k") for _ in range(30)]
    params = {"ids": store.int_array(ids), "low": ids[0], "high": ids[-1], "max_bytes": 1 << 20}
    names = ranges(engine, schema)
    direct = store._range_sql(schema, names[0])
    parent = store.driver_sql(store.query("read_deliverable", schema))
    url = services.database_url
    assert locked_partitions(url, schema, direct, params) == {names[0]}
    assert locked_partitions(url, schema, parent, params) >= set(names) | {"message_default"}
    fetch = {"shards": store.int_array(range(SHARDS)), "limit": 50,
             "in_flight": store.id_ranges(()), "held": [], "max_bytes": 1 << 20}
    batch = store._batch_sql(schema, names[0])
    assert locked_partitions(url, schema, batch, fetch) == {names[0]}


def test_a_batch_whose_range_was_dropped_since_is_read_through_message(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """Retention drops a range after moving its unfinished messages (delayed, unresolved)
    to the default partition; when one of them comes due, the relay's list of ranges still
    names the dropped range. The read falls back to `message`, and reads the list again."""
    use_ranges(engine, schema, 100, ahead=3)
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, f"m{i}".encode(), key="k") for i in range(20)]
    names = ranges(engine, schema)
    url = sqlalchemy_url(services.database_url)
    fetching = store.engine(url, settings=store.FETCHING_SETTINGS, poolclass=NullPool)
    params = {"ids": store.int_array(ids), "low": ids[0], "high": ids[-1], "max_bytes": 1 << 20}
    try:
        with fetching.connect() as planned_once:
            reading = store.Fetching(planned_once, schema)
            for _ in range(6):  # prepared, and planned once
                assert reading.read(params) is not None
            assert reading.hot == names[0]
            with engine.begin() as conn:  # what drop_expired_partition does
                conn.execute(text(f"ALTER TABLE {schema}.message DETACH PARTITION "
                                  f"{schema}.{names[0]}"))
                conn.execute(text(f"INSERT INTO {schema}.message "
                                  f"SELECT * FROM {schema}.{names[0]}"))
                conn.execute(text(f"DROP TABLE {schema}.{names[0]}"))
            fetch = {"shards": store.int_array(range(SHARDS)), "limit": 50,
                     "in_flight": store.id_ranges(()), "held": [], "max_bytes": 1 << 20}
            assert reading.batch(fetch) is None and reading.hot is None
            assert reading.read(params) is None
            assert reading.range_of(ids[0], ids[-1]) is None  # the list read again
            with engine.connect() as conn:
                batch = store.fetch_deliverable(conn, schema, range(SHARDS), 50,
                                                fetching=reading)
    finally:
        fetching.dispose()
    assert [(r.id, r.payload) for r in batch] == [(i, f"m{n}".encode()) for n, i in enumerate(ids)]


def test_recording_a_batch_reads_its_rows_not_the_backlog(
        services: devservices.Services, engine: Engine, outbox: Outbox, schema: str,
        topic: str) -> None:
    """Joined with the acks as a set, the DELETE of delivered pending rows hash-joined them
    with every pending row: 10 ms of a batch's 20 at a 50,000-message backlog, growing with
    it. It must delete by key; so must the relay's failure count."""
    with Session(engine) as session, session.begin():
        ids = [outbox.publish(session, topic, b"x", key=f"k{i % 50}") for i in range(3000)]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {schema}.message, {schema}.pending"))
    acked = ids[:150]  # a batch of 2,000 at a 40,000 backlog
    statements = recording(acked)
    for name, params in statements.items():
        plan = explained(engine, schema, name, params)
        assert rows_read(plan, "pending") <= len(acked), (name, plan)
    assert_the_recorder_reads_only(services, schema, statements, len(acked))


def test_a_publish_does_not_call_the_pending_row_check(
        engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Revision 0005's trigger checked every pending row against its message: a plpgsql call
    and a lookup of `message` planned for each row. publish_message() (revision 0014) derives
    what it checked from the message it has just written, and the trigger skips its rows."""
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL track_functions = 'pl'"))
        for i in range(3):
            outbox.publish(conn, topic, b"x", key=f"k{i}")
        calls = conn.execute(text(
            "SELECT pg_stat_get_xact_function_calls(CAST(:function AS regproc)), "
            "pg_stat_get_xact_function_calls(CAST(:trigger AS regproc))"),
            {"function": f"{schema}.publish_message",
             "trigger": f"{schema}.pending_born_pending"}).one()
    assert tuple(calls) == (3, None)


def test_a_publish_locks_only_the_partition_its_message_goes_to(
        application: Engine, engine: Engine, outbox: Outbox, schema: str, topic: str) -> None:
    """Before revision 0014 the trigger's lookup ran a generic plan from an application
    session's sixth publish, which locked every partition of `message` until the transaction
    ended (here 14 from then on, 2 before)."""
    use_ranges(engine, schema, 100, ahead=12)
    locked = []
    with application.connect() as conn:
        for _ in range(8):
            with conn.begin():
                outbox.publish(conn, topic, b"x", key="k")
                locked.append(conn.execute(text(
                    "SELECT count(*) FROM pg_locks AS l JOIN pg_inherits AS i "
                    "ON i.inhrelid = l.relation WHERE l.pid = pg_backend_pid() "
                    "AND i.inhparent = CAST(:message AS regclass)"),
                    {"message": f"{schema}.message"}).scalar_one())
    assert len(ranges(engine, schema)) >= 12
    assert locked == [1] * 8
