-- The outbox's queries, one named block each. Only outbox/store.py reads this file.
-- {schema} is replaced by the validated schema name; :name marks a bound parameter.

-- name: publish
-- Write a prepare row in the caller's transaction. A keyed row first takes a
-- transaction-scoped advisory lock on its (topic, key) hash, so rows of one key get their
-- ids in commit order and the relay's id order is the key's order. pg_notify (unless turned
-- off) is queued and sent by PostgreSQL only if the transaction commits. A row due later starts DELAYED;
-- times are the database's clock, not the application's.
INSERT INTO {schema}.message
    (producer_group, topic, key, header_keys, header_values, payload, content_type,
     resolution, status, shard, next_check_at, deliver_after)
SELECT :producer_group, :topic, :key, :header_keys, :header_values, :payload, :content_type,
       :resolution,
       CASE WHEN due.at > now() THEN 'DELAYED' ELSE 'PENDING' END,
       :shard,
       now() + make_interval(secs => CAST(:check_after_seconds AS double precision)),
       due.at
FROM (SELECT count(pg_advisory_xact_lock(:lock_class, :lock_key))
      FROM (SELECT WHERE CAST(:lock_key AS integer) IS NOT NULL) AS keyed) AS lock,
     (SELECT coalesce(CAST(:deliver_at AS timestamptz),
                      now() + make_interval(secs => CAST(:delay_seconds AS double precision)))
             AS at) AS due
RETURNING id, CASE WHEN CAST(:notify AS boolean) THEN pg_notify(:channel, '') END;

-- name: fetch_deliverable
-- The relay's next batch: committed, undelivered rows of the shards it owns, in id order,
-- skipping rows held back by an earlier row of their key that is still DELAYED or UNKNOWN,
-- and the rows of the batch it has in flight.
-- Walks the partial index of pending rows, so its cost follows the backlog, not the history.
SELECT m.id, m.topic, m.key, m.header_keys, m.header_values, m.payload, m.content_type
FROM {schema}.message AS m
WHERE m.status = 'PENDING' AND m.resolution = 'COMMIT'
  AND m.shard = ANY(CAST(:shards AS smallint[]))
  AND NOT EXISTS (
      SELECT FROM {schema}.message AS h
      WHERE h.topic = m.topic AND h.key = m.key AND h.id < m.id
        AND h.key IS NOT NULL
        AND (h.status = 'DELAYED' OR (h.status = 'PENDING' AND h.resolution = 'UNKNOWN')))
  AND m.id <> ALL(CAST(:in_flight AS bigint[]))
ORDER BY m.id
LIMIT :limit;

-- name: promote_due
-- Delayed rows whose time has come become PENDING; returns how many, and the seconds until
-- the next one is due (NULL when none is waiting).
WITH promoted AS (
    UPDATE {schema}.message SET status = 'PENDING'
    WHERE status = 'DELAYED' AND deliver_after <= now()
      AND shard = ANY(CAST(:shards AS smallint[]))
    RETURNING id
)
SELECT (SELECT count(*) FROM promoted) AS promoted,
       (SELECT extract(epoch FROM min(deliver_after) - now()) FROM {schema}.message
        WHERE status = 'DELAYED' AND deliver_after > now()
          AND shard = ANY(CAST(:shards AS smallint[]))) AS next_due_in;

-- name: mark_delivered
-- Close a delivered batch: the rows leave the pending index and each gets an op record
-- with the partition and offset Kafka acknowledged, in one statement. A row another relay
-- already closed is left alone. Returns each row's commit-to-ack latency (database clock).
WITH delivered AS (
    UPDATE {schema}.message AS m
    SET status = 'DELIVERED', delivered_at = now(), attempts = m.attempts + 1, last_error = NULL
    FROM unnest(CAST(:ids AS bigint[]), CAST(:partitions AS integer[]),
                CAST(:offsets AS bigint[])) AS d(id, kafka_partition, kafka_offset)
    WHERE m.id = d.id AND m.status = 'PENDING'
    RETURNING m.id, m.topic, m.created_at, d.kafka_partition, d.kafka_offset
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, kafka_offset)
    SELECT id, 'DELIVERED', :actor, kafka_partition, kafka_offset FROM delivered
)
SELECT topic, extract(epoch FROM clock_timestamp() - created_at) AS latency FROM delivered;

-- name: record_failures
-- Count failed attempts and keep the broker's reason; a row rejected permanently
-- :max_attempts times is PARKED with an op record, so it never blocks the relay again.
WITH failed AS (
    UPDATE {schema}.message AS m
    SET attempts = m.attempts + 1, last_error = f.error,
        status = CASE WHEN f.permanent AND m.attempts + 1 >= :max_attempts
                      THEN 'PARKED' ELSE m.status END
    FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[]),
                CAST(:permanent AS boolean[])) AS f(id, error, permanent)
    WHERE m.id = f.id AND m.status = 'PENDING'
    RETURNING m.id, m.topic, m.status, f.error
), parked AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT id, 'PARKED', :actor, error FROM failed WHERE status = 'PARKED'
)
SELECT id, topic, status FROM failed;

-- name: lock_migrations
-- Migrations of one schema take turns: held until the migrating transaction ends.
SELECT pg_advisory_xact_lock(:lock_class, hashtext(:schema_name));

-- name: claim_worker_id
-- A relay holds a session advisory lock on (schema, worker id) for as long as it runs, on a
-- connection of its own: a second live process with the same id cannot take it and is
-- refused; a dead one's lock goes with its connection (kill -9 included).
SELECT pg_try_advisory_lock(:lock_class, hashtext(:schema_name || '/' || :worker_id));

-- name: heartbeat
-- A relay says it is alive (and how many messages it has in flight), and forgets relays
-- silent for ten lease lengths. Returns whether it just joined.
WITH gone AS (
    DELETE FROM {schema}.relay_member
    WHERE seen_at < now() - make_interval(secs => :lease_seconds * 10)
)
INSERT INTO {schema}.relay_member (worker_id, seen_at, in_flight)
VALUES (:worker_id, now(), :in_flight)
ON CONFLICT (worker_id) DO UPDATE SET seen_at = now(), in_flight = EXCLUDED.in_flight
RETURNING xmax = 0 AS joined;

-- name: notify_rebalance
-- Tell the other relays to look at their shares now (a relay joined or left).
SELECT pg_notify(:channel, 'rebalance');

-- name: live_relays
SELECT count(*) FROM {schema}.relay_member
WHERE seen_at > now() - make_interval(secs => :lease_seconds);

-- name: renew_leases
UPDATE {schema}.relay_lease
SET expires_at = now() + make_interval(secs => :lease_seconds)
WHERE owner = :worker_id
RETURNING shard;

-- name: claim_leases
-- Take up to :wanted free or expired shards; SKIP LOCKED lets relays claim side by side.
UPDATE {schema}.relay_lease
SET owner = :worker_id, expires_at = now() + make_interval(secs => :lease_seconds)
WHERE shard IN (
    SELECT shard FROM {schema}.relay_lease
    WHERE owner IS NULL OR expires_at < now()
    ORDER BY shard
    LIMIT :wanted
    FOR UPDATE SKIP LOCKED
)
RETURNING shard;

-- name: release_leases
-- Hand shards back and tell the other relays, so one claims them at once.
WITH released AS (
    UPDATE {schema}.relay_lease
    SET owner = NULL, expires_at = NULL
    WHERE owner = :worker_id AND shard = ANY(CAST(:shards AS smallint[]))
)
SELECT pg_notify(:channel, 'rebalance');

-- name: leave
-- A relay stopping gracefully hands all its shards back at once and tells the others.
WITH released AS (
    UPDATE {schema}.relay_lease SET owner = NULL, expires_at = NULL WHERE owner = :worker_id
), gone AS (
    DELETE FROM {schema}.relay_member WHERE worker_id = :worker_id
)
SELECT pg_notify(:channel, 'rebalance');

-- name: resume
-- Re-queue PARKED rows for delivery and re-arm the check-backs of DISCARDED rows
-- (RocketMQ's RESUME_CHECK_HALF_MESSAGE); each gets a RESUMED op record.
WITH resumed AS (
    UPDATE {schema}.message AS m
    SET status = CASE WHEN m.deliver_after > now() THEN 'DELAYED' ELSE 'PENDING' END,
        attempts = 0, last_error = NULL,
        check_count = CASE WHEN old.status = 'DISCARDED' THEN 0 ELSE m.check_count END,
        next_check_at = CASE WHEN old.status = 'DISCARDED' THEN now() ELSE m.next_check_at END
    FROM {schema}.message AS old
    WHERE old.id = m.id AND m.status IN ('PARKED', 'DISCARDED')
      AND (m.id = ANY(CAST(:ids AS bigint[])) OR CAST(:all AS boolean))
    RETURNING m.id, old.status AS was
)
INSERT INTO {schema}.op_record (message_id, action, actor, detail)
SELECT id, 'RESUMED', :actor, 'was ' || was FROM resumed
RETURNING message_id, detail, pg_notify(:channel, '');

-- name: backlog
-- Undelivered messages by state for the metrics, each counted through its partial index.
SELECT
    (SELECT count(*) FROM {schema}.message
     WHERE status = 'PENDING' AND resolution = 'COMMIT') AS pending,
    (SELECT count(*) FROM {schema}.message
     WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')) AS unresolved,
    (SELECT count(*) FROM {schema}.message WHERE status = 'DELAYED') AS delayed,
    (SELECT count(*) FROM {schema}.message
     WHERE status IN ('PARKED', 'DISCARDED') AND status = 'PARKED') AS parked,
    (SELECT count(*) FROM {schema}.message
     WHERE status IN ('PARKED', 'DISCARDED') AND status = 'DISCARDED') AS discarded;

-- name: status_by_topic
-- What `outbox status` shows per topic. Only undelivered rows (found through the partial
-- indexes) and the last minute of op records are read, so it stays cheap on a long history.
WITH undelivered AS (
    SELECT topic, status, resolution, created_at FROM {schema}.message
    WHERE status = 'PENDING' AND resolution = 'COMMIT'
    UNION ALL
    SELECT topic, status, resolution, created_at FROM {schema}.message
    WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
    UNION ALL
    SELECT topic, status, resolution, created_at FROM {schema}.message
    WHERE status = 'DELAYED' AND resolution <> 'UNKNOWN'
    UNION ALL
    SELECT topic, status, resolution, created_at FROM {schema}.message
    WHERE status IN ('PARKED', 'DISCARDED')
), counts AS (
    SELECT topic,
           count(*) FILTER (WHERE status = 'PENDING' AND resolution = 'COMMIT') AS pending,
           count(*) FILTER (WHERE resolution = 'UNKNOWN'
                            AND status IN ('PENDING', 'DELAYED')) AS unresolved,
           count(*) FILTER (WHERE status = 'DELAYED' AND resolution <> 'UNKNOWN') AS delayed,
           count(*) FILTER (WHERE status = 'PARKED') AS parked,
           count(*) FILTER (WHERE status = 'DISCARDED') AS discarded,
           extract(epoch FROM now() - min(created_at) FILTER (
               WHERE status IN ('PENDING', 'DELAYED'))) AS oldest_undelivered_seconds
    FROM undelivered GROUP BY topic
), recent AS (
    SELECT m.topic, count(*) AS delivered_last_minute
    FROM {schema}.op_record AS o JOIN {schema}.message AS m ON m.id = o.message_id
    WHERE o.action = 'DELIVERED' AND o.created_at > now() - interval '1 minute'
    GROUP BY m.topic
)
SELECT coalesce(c.topic, r.topic) AS topic,
       coalesce(c.pending, 0) AS pending, coalesce(c.unresolved, 0) AS unresolved,
       coalesce(c.delayed, 0) AS delayed, coalesce(c.parked, 0) AS parked,
       coalesce(c.discarded, 0) AS discarded,
       coalesce(r.delivered_last_minute, 0) AS delivered_last_minute,
       c.oldest_undelivered_seconds
FROM counts AS c FULL JOIN recent AS r ON r.topic = c.topic
ORDER BY 1;

-- name: relays
-- The live relays, their shards and the messages they have in flight.
SELECT r.worker_id, r.in_flight, extract(epoch FROM now() - r.seen_at) AS seen_seconds_ago,
       (SELECT count(*) FROM {schema}.relay_lease AS l
        WHERE l.owner = r.worker_id AND l.expires_at > now()) AS shards
FROM {schema}.relay_member AS r
WHERE r.seen_at > now() - make_interval(secs => :lease_seconds)
ORDER BY r.worker_id;

-- name: prune_messages
-- Retention: delete up to :limit delivered or rolled-back rows older than the window
-- (found through the BRIN index on created_at). PARKED and DISCARDED rows are kept for
-- an operator. Short, bounded statements, so the relay is never blocked for long.
DELETE FROM {schema}.message
WHERE id IN (
    SELECT id FROM {schema}.message
    WHERE created_at < now() - make_interval(secs => :retention_seconds)
      AND status IN ('DELIVERED', 'ROLLED_BACK')
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
);

-- name: prune_op_records
-- Op records past the window, except those of rows still kept (PARKED, DISCARDED, or not
-- yet delivered), whose history an operator needs.
DELETE FROM {schema}.op_record
WHERE id IN (
    SELECT o.id FROM {schema}.op_record AS o
    WHERE o.created_at < now() - make_interval(secs => :retention_seconds)
      AND NOT EXISTS (
          SELECT FROM {schema}.message AS m
          WHERE m.id = o.message_id AND m.status NOT IN ('DELIVERED', 'ROLLED_BACK'))
    LIMIT :limit
    FOR UPDATE OF o SKIP LOCKED
);

-- name: table_exists
SELECT to_regclass(:table) IS NOT NULL;

-- name: schema_version
SELECT version_num FROM {schema}.outbox_alembic_version;

-- name: decide
-- An application's decision on an UNKNOWN message (RocketMQ's endTransaction). The row is
-- locked first so the answer reflects a decision that committed meanwhile; only an UNKNOWN
-- row changes, so no decision or check-back ever overrides an earlier one. A DISCARDED row
-- can still be decided (a late COMMIT is delivered, with a RESUMED op record). Returns
-- nothing for an unknown id, else the resolution found and whether this call changed it.
WITH target AS (
    SELECT id, resolution, status FROM {schema}.message WHERE id = :id FOR UPDATE
), decided AS (
    UPDATE {schema}.message AS m
    SET resolution = CAST(:resolution AS text),
        status = CASE WHEN CAST(:resolution AS text) = 'ROLLBACK' THEN 'ROLLED_BACK'
                      WHEN m.status = 'DISCARDED' AND m.deliver_after > now() THEN 'DELAYED'
                      WHEN m.status = 'DISCARDED' THEN 'PENDING' ELSE m.status END,
        next_check_at = NULL
    FROM target
    WHERE m.id = target.id AND m.resolution = 'UNKNOWN'
      AND m.status IN ('PENDING', 'DELAYED', 'DISCARDED')
    RETURNING m.id, m.status, target.status AS was
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT id, CASE WHEN status = 'ROLLED_BACK' THEN 'ROLLED_BACK' ELSE 'RESUMED' END, :actor,
           CASE WHEN was = 'DISCARDED' THEN 'was DISCARDED; ' ELSE '' END
           || 'decided ' || CAST(:resolution AS text) || ' by the application'
    FROM decided WHERE status = 'ROLLED_BACK' OR was = 'DISCARDED'
)
SELECT target.resolution AS was_resolution, EXISTS (SELECT FROM decided) AS decided,
       (SELECT count(pg_notify(:channel, '')) FROM decided WHERE status = 'PENDING') AS notified
FROM target;

-- name: claim_checks
-- A sweeper claims due UNKNOWN rows of the producer groups it has checkers for, through the
-- partial index message_check_idx (its cost follows the due rows, not the history). The
-- claim pushes next_check_at past the checker timeout: other sweepers skip the row until
-- then, and a crashed sweeper's claim simply expires. The new next_check_at is the claim's
-- token: only its holder may record the check's outcome (record_checks).
WITH due AS (
    SELECT id FROM {schema}.message
    WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
      AND next_check_at <= now()
      AND producer_group = ANY(CAST(:groups AS text[]))
    ORDER BY next_check_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.message AS m
SET next_check_at = now() + make_interval(secs => :claim_seconds)
FROM due
WHERE m.id = due.id
RETURNING m.id, m.producer_group, m.topic, m.key, m.header_keys, m.header_values, m.payload,
          m.content_type, m.created_at, m.check_count, m.next_check_at AS token;

-- name: record_checks
-- Check-back outcomes, each recorded only while its claim holds (next_check_at = token)
-- and the row is still UNKNOWN: a decision, or a record that came first, always wins.
-- COMMIT leaves the row to the relay (and wakes it); ROLLBACK closes it with an op record;
-- an inconclusive answer schedules the next check, or at the :check_max-th discards the row
-- with an op record (RocketMQ's TRANS_CHECK_MAX_TIME_TOPIC). Returns the rows it changed.
WITH outcome AS (
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS timestamptz[]),
                         CAST(:resolutions AS text[]), CAST(:details AS text[]))
             AS o(id, token, resolution, detail)
), checked AS (
    UPDATE {schema}.message AS m
    SET check_count = m.check_count + 1,
        resolution = o.resolution,
        status = CASE WHEN o.resolution = 'ROLLBACK' THEN 'ROLLED_BACK'
                      WHEN o.resolution = 'UNKNOWN' AND m.check_count + 1 >= :check_max
                      THEN 'DISCARDED'
                      ELSE m.status END,
        next_check_at = CASE WHEN o.resolution = 'UNKNOWN' AND m.check_count + 1 < :check_max
                             THEN now() + make_interval(secs => :check_interval) END
    FROM outcome AS o
    WHERE m.id = o.id AND m.next_check_at = o.token
      AND m.resolution = 'UNKNOWN' AND m.status IN ('PENDING', 'DELAYED')
    RETURNING m.id, m.producer_group, m.resolution, m.status, m.check_count, o.detail
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT id, status, :actor,
           CASE WHEN status = 'DISCARDED'
                THEN check_count || ' inconclusive check-backs, the last: ' || detail
                ELSE 'check-back ' || check_count || ': ' || detail END
    FROM checked WHERE status IN ('ROLLED_BACK', 'DISCARDED')
)
SELECT id, producer_group, resolution, status, check_count,
       (SELECT count(pg_notify(:channel, '')) FROM checked
        WHERE resolution = 'COMMIT' AND status = 'PENDING') AS notified
FROM checked;

-- name: next_check_in
-- Seconds until the sweeper's next due row (NULL when none waits), from the index's first entry.
SELECT extract(epoch FROM min(next_check_at) - now()) FROM {schema}.message
WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
  AND producer_group = ANY(CAST(:groups AS text[]));

-- name: unchecked_groups
-- Due UNKNOWN rows of producer groups the sweeper has no checker for: reported, not counted.
SELECT producer_group, count(*) AS due FROM {schema}.message
WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED') AND next_check_at <= now()
  AND producer_group <> ALL(CAST(:groups AS text[]))
GROUP BY producer_group
ORDER BY producer_group;

-- name: begin_check
-- A checker's transaction is read-only and its statements are cut off at the checker timeout.
SELECT set_config('transaction_read_only', 'on', true),
       set_config('statement_timeout', :timeout_ms, true);

-- name: discarded
-- What `outbox discarded` lists: rows whose check-backs all stayed inconclusive.
SELECT m.id, m.producer_group, m.topic, m.key, m.check_count, m.created_at,
       d.created_at AS discarded_at, d.detail
FROM {schema}.message AS m
LEFT JOIN LATERAL (
    SELECT o.created_at, o.detail FROM {schema}.op_record AS o
    WHERE o.message_id = m.id AND o.action = 'DISCARDED'
    ORDER BY o.id DESC
    LIMIT 1
) AS d ON true
WHERE m.status = 'DISCARDED'
ORDER BY m.id
LIMIT :limit;

-- name: check_backlog
-- UNKNOWN messages per producer group for `outbox status`, through message_check_idx. An
-- overdue one has waited for its check-back longer than a sweeper takes to claim it: no
-- running sweeper has a checker for its group, or the sweepers cannot keep up.
SELECT producer_group, count(*) AS unresolved,
       count(*) FILTER (WHERE next_check_at < now() - make_interval(secs => :overdue_seconds))
       AS overdue
FROM {schema}.message
WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
GROUP BY producer_group
ORDER BY producer_group;

-- name: create_roles
-- Least-privilege group roles (NOLOGIN; grant them to your login roles):
--   {schema}_app      writes prepare rows and decisions, reads no payloads, deletes nothing;
--   {schema}_relay    delivers, keeps leases and prunes;
--   {schema}_sweeper  checks back (grant it SELECT on the tables your SQL checkers read).
DO $roles$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['{schema}_app', '{schema}_relay', '{schema}_sweeper'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name) THEN
            EXECUTE 'CREATE ROLE ' || quote_ident(name) || ' NOLOGIN';
        END IF;
    END LOOP;
END
$roles$;
GRANT USAGE ON SCHEMA {schema} TO {schema}_app, {schema}_relay, {schema}_sweeper;
GRANT SELECT ON {schema}.outbox_alembic_version TO {schema}_app, {schema}_relay, {schema}_sweeper;
GRANT INSERT ON {schema}.message TO {schema}_app;
GRANT SELECT (id, resolution, status, deliver_after),
      UPDATE (resolution, status, next_check_at)
    ON {schema}.message TO {schema}_app;
GRANT INSERT ON {schema}.op_record TO {schema}_app;
GRANT SELECT, UPDATE, DELETE ON {schema}.message TO {schema}_relay;
GRANT SELECT, INSERT, DELETE ON {schema}.op_record TO {schema}_relay;
GRANT SELECT, UPDATE ON {schema}.relay_lease TO {schema}_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.relay_member TO {schema}_relay;
GRANT SELECT, UPDATE ON {schema}.message TO {schema}_sweeper;
GRANT SELECT, INSERT ON {schema}.op_record TO {schema}_sweeper;

-- name: create_reconcile_role
-- The reconciliation job's group role (NOLOGIN), {schema}_reconcile: reads every table of the
-- schema (also tables later migrations add: default privileges), writes only reconcile_run,
-- and is a member of pg_read_all_stats, so it sees other roles' open transactions in
-- pg_stat_activity and holds its window end back for them. Granting that membership needs a
-- superuser (or ADMIN OPTION on it); otherwise the role is made without it and the job
-- refuses to run under it until someone grants it.
DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_reconcile') THEN
        CREATE ROLE {schema}_reconcile NOLOGIN;
    END IF;
    BEGIN
        GRANT pg_read_all_stats TO {schema}_reconcile;
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE WARNING 'a superuser must run: GRANT pg_read_all_stats TO {schema}_reconcile';
    END;
END
$role$;
GRANT USAGE ON SCHEMA {schema} TO {schema}_reconcile;
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {schema}_reconcile;
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO {schema}_reconcile;
GRANT INSERT ON {schema}.reconcile_run TO {schema}_reconcile;
