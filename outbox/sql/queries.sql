-- The outbox's queries, one named block each. Only outbox/store.py reads this file.
-- {schema} is replaced by the validated schema name; :name marks a bound parameter.

-- name: publish
-- Write a prepare row in the caller's transaction. A keyed row first takes a
-- transaction-scoped advisory lock on its (topic, key) hash, so rows of one key get their
-- ids in commit order and the relay's id order is the key's order. pg_notify is queued and
-- sent by PostgreSQL only if the transaction commits.
INSERT INTO {schema}.message
    (producer_group, topic, key, header_keys, header_values, payload, content_type,
     resolution, shard, next_check_at, deliver_after)
SELECT :producer_group, :topic, :key, :header_keys, :header_values, :payload, :content_type,
       :resolution, :shard, :next_check_at, :deliver_after
FROM (SELECT count(pg_advisory_xact_lock(:lock_class, :lock_key))
      FROM (SELECT WHERE CAST(:lock_key AS integer) IS NOT NULL) AS keyed) AS lock
RETURNING id, pg_notify(:channel, '');

-- name: fetch_deliverable
-- The relay's next batch: committed, undelivered rows of the shards it owns, in id order.
-- Walks the partial index of pending rows, so its cost follows the backlog, not the history.
SELECT id, topic, key, header_keys, header_values, payload, content_type
FROM {schema}.message
WHERE status = 'PENDING' AND resolution = 'COMMIT'
  AND shard = ANY(CAST(:shards AS smallint[]))
  AND (deliver_after IS NULL OR deliver_after <= now())
ORDER BY id
LIMIT :limit;

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

-- name: schema_version
SELECT version_num FROM {schema}.outbox_alembic_version;
