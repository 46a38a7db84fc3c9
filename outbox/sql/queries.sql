-- The outbox's queries, one named block each. Only outbox/store.py reads this file.
-- {schema} is replaced by the validated schema name; :name marks a bound parameter.

-- name: publish
-- Write a prepare row in the caller's transaction. A keyed row first takes a
-- transaction-scoped advisory lock on its (topic, key) hash, so rows of one key get their
-- ids in commit order and the relay's id order is the key's order. pg_notify is queued and
-- sent by PostgreSQL only if the transaction commits. A row due later starts DELAYED;
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
RETURNING id, pg_notify(:channel, '');

-- name: fetch_deliverable
-- The relay's next batch: committed, undelivered rows of the shards it owns, in id order,
-- skipping rows held back by an earlier row of their key that is still DELAYED or UNKNOWN.
-- Walks the partial index of pending rows, so its cost follows the backlog, not the history.
SELECT m.id, m.topic, m.key, m.header_keys, m.header_values, m.payload, m.content_type,
       m.created_at
FROM {schema}.message AS m
WHERE m.status = 'PENDING' AND m.resolution = 'COMMIT'
  AND m.shard = ANY(CAST(:shards AS smallint[]))
  AND NOT EXISTS (
      SELECT FROM {schema}.message AS h
      WHERE h.topic = m.topic AND h.key = m.key AND h.id < m.id
        AND h.key IS NOT NULL
        AND (h.status = 'DELAYED' OR (h.status = 'PENDING' AND h.resolution = 'UNKNOWN')))
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
-- with the partition and offset Kafka acknowledged, in one statement.
WITH delivered AS (
    UPDATE {schema}.message AS m
    SET status = 'DELIVERED', delivered_at = now(), attempts = m.attempts + 1, last_error = NULL
    FROM unnest(CAST(:ids AS bigint[]), CAST(:partitions AS integer[]),
                CAST(:offsets AS bigint[])) AS d(id, kafka_partition, kafka_offset)
    WHERE m.id = d.id AND m.status = 'PENDING'
    RETURNING m.id, d.kafka_partition, d.kafka_offset
)
INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, kafka_offset)
SELECT id, 'DELIVERED', :actor, kafka_partition, kafka_offset FROM delivered;

-- name: record_failure
-- A delivery attempt failed: count it and keep the broker's reason.
UPDATE {schema}.message
SET attempts = attempts + 1, last_error = :error
WHERE id = ANY(CAST(:ids AS bigint[])) AND status = 'PENDING';

-- name: heartbeat
-- A relay says it is alive, and forgets relays silent for ten lease lengths.
WITH gone AS (
    DELETE FROM {schema}.relay_member
    WHERE seen_at < now() - make_interval(secs => :lease_seconds * 10)
)
INSERT INTO {schema}.relay_member (worker_id, seen_at) VALUES (:worker_id, now())
ON CONFLICT (worker_id) DO UPDATE SET seen_at = now();

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
UPDATE {schema}.relay_lease
SET owner = NULL, expires_at = NULL
WHERE owner = :worker_id AND shard = ANY(CAST(:shards AS smallint[]));

-- name: leave
-- A relay stopping gracefully hands all its shards back at once.
WITH released AS (
    UPDATE {schema}.relay_lease SET owner = NULL, expires_at = NULL WHERE owner = :worker_id
)
DELETE FROM {schema}.relay_member WHERE worker_id = :worker_id;

-- name: resume
-- Re-queue PARKED rows for delivery and re-arm the check-backs of DISCARDED rows
-- (RocketMQ's RESUME_CHECK_HALF_MESSAGE); each gets a RESUMED op record.
WITH resumed AS (
    UPDATE {schema}.message AS m
    SET status = 'PENDING', attempts = 0, last_error = NULL,
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

-- name: table_exists
SELECT to_regclass(:table) IS NOT NULL;

-- name: schema_version
SELECT version_num FROM {schema}.outbox_alembic_version;
