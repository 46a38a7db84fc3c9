-- The outbox's queries, one named block each. Only outbox/store.py reads this file.
-- {schema} is replaced by the validated schema name; :name marks a bound parameter.

-- name: publish
-- Write a prepare row in the caller's transaction, through publish_message() (revision 0014,
-- the application role's only way to write one): the message row, written once and never
-- updated, and its narrow pending row, which the relay deletes on delivery. A keyed row first
-- takes a transaction-scoped advisory lock on its (topic, key) hash, so rows of one key get
-- their ids in commit order and the relay's id order is the key's order. A row due later
-- starts DELAYED; times are the database's clock.
-- The wake-up (unless turned off): pg_notify is queued and sent by PostgreSQL only if the
-- transaction commits, and PostgreSQL commits notifying transactions one at a time. So a row
-- notifies only if a relay sleeps on its shard (holds the shard's wake lock, `fall_asleep`)
-- or is DELAYED (and says so). Otherwise it holds the wake lock shared until it commits: a
-- relay cannot fall asleep on the shard before the row is visible to its next fetch.
-- Every argument is cast, so each driver's types resolve to the one function.
SELECT {schema}.publish_message(
    producer_group => CAST(:producer_group AS text), topic => CAST(:topic AS text),
    key => CAST(:key AS bytea), header_keys => CAST(:header_keys AS text[]),
    header_values => CAST(:header_values AS bytea[]), payload => CAST(:payload AS bytea),
    content_type => CAST(:content_type AS text), shard => CAST(:shard AS smallint),
    deliver_at => CAST(:deliver_at AS timestamptz),
    delay_seconds => CAST(:delay_seconds AS double precision),
    resolution => CAST(:resolution AS text),
    check_after_seconds => CAST(:check_after_seconds AS double precision),
    lock_class => CAST(:lock_class AS integer), lock_key => CAST(:lock_key AS integer),
    notify => CAST(:notify AS boolean), wake_class => CAST(:wake_class AS integer),
    wake_base => CAST(:wake_base AS integer), channel => CAST(:channel AS text),
    delayed_note => CAST(:delayed_note AS text)) AS id;

-- name: fetch_deliverable
-- The relay's next batch, step 1: the ids of committed, undelivered rows of the shards it
-- owns, in id order, skipping rows held back by an earlier row of their key that is still
-- DELAYED or UNKNOWN or held, the rows of the batch it has in flight and those of topics it
-- holds (relay/holds.py: flagged `held`, out of the index the walk reads; :held names them,
-- for their rows not flagged yet); at most :limit. Chosen in the pending table alone (its
-- partial index: the cost follows the backlog). The relay runs it with enable_sort off
-- (store.engine): every way but that walk sorts. It runs on a plan made once
-- (store.fetch_deliverable). The ids in flight come as ranges (store.IdRanges), each row
-- tested by a binary search: as an array the planner weighed each of them (2.8 ms of
-- planning with 6,000 in flight), and a plan made once compared each row with each of
-- them. The OFFSET 0 in held_back keeps the key-hold test a probe of pending_hold_idx per
-- row: as an anti-join, rows holding keys back that came after the statistics looked like
-- one, and each batch read them all, once or once a row (6.2 s a batch of 500 over 100,000
-- held rows, instead of 2 ms).
SELECT p.message_id
FROM {schema}.pending AS p
WHERE p.status = 'PENDING' AND p.resolution = 'COMMIT' AND NOT p.held
  AND p.shard = ANY(CAST(:shards AS smallint[]))
  AND NOT {held_back}
  AND NOT (CAST(:in_flight AS int8multirange) @> p.message_id)
  AND p.topic <> ALL(CAST(:held AS text[]))
ORDER BY p.message_id
LIMIT :limit;

-- name: held_back
-- Whether the pending row p is held back by an earlier row of its key (same topic and key)
-- that is DELAYED, UNKNOWN or held: a condition of fetch_deliverable and try_held, not a
-- query of its own. pending_hold_idx holds a key by its first 2,048 bytes (revision 0025:
-- B-tree entries are capped at 2,704 bytes): the probe compares those, then the keys.
EXISTS (
    SELECT FROM {schema}.pending AS h
    WHERE h.topic = p.topic AND substr(h.key, 1, 2048) = substr(p.key, 1, 2048)
      AND h.key = p.key AND h.message_id < p.message_id
      AND h.key IS NOT NULL
      AND (h.status = 'DELAYED' OR (h.status = 'PENDING' AND h.resolution = 'UNKNOWN')
           OR h.held)
    OFFSET 0)

-- name: read_deliverable
-- Step 2: the messages of those ids (:ids, ascending, from :low to :high), in id order, no
-- more payload bytes than :max_bytes (but always the first row). Each is read by primary
-- key (the LATERAL with OFFSET 0 keeps it a lookup: joined as a set, the planner merge-joined
-- or hash-joined the ids with every partition of `message`, reading the whole retained
-- history per batch), and the bounds are constants of the statement, so PostgreSQL plans
-- only the partitions between them, one or two. In one statement with step 1 every
-- partition of retained history was planned, locked and started for every batch: at 257
-- partitions (72 h of 1,000 msg/s) a fetch of 4 rows took 7.6 ms instead of 0.6. As
-- `= ANY(:ids)` the planner weighed each of 2,000 ids: 2 ms of planning. The relay reads
-- the batch's one range itself where it can (store.Fetching): planned once, locking it alone.
-- The running sum's frame is ROWS (ids are unique: the same sums), which spares the window
-- looking ahead for peers: 0.5 ms less a batch of 2,000 1 KiB messages.
SELECT id, topic, key, header_keys, header_values, payload, content_type
FROM (
    SELECT m.id, m.topic, m.key, m.header_keys, m.header_values, m.payload, m.content_type,
           sum(octet_length(m.payload)) OVER (ORDER BY i.id ROWS UNBOUNDED PRECEDING)
           AS bytes_so_far
    FROM unnest(CAST(:ids AS bigint[])) AS i(id)
    CROSS JOIN LATERAL (
        SELECT m.id, m.topic, m.key, m.header_keys, m.header_values, m.payload, m.content_type
        FROM {schema}.message AS m
        WHERE m.id = i.id AND m.id BETWEEN :low AND :high
        OFFSET 0
    ) AS m
) AS batch
WHERE bytes_so_far - octet_length(payload) < :max_bytes
ORDER BY id;

-- name: fetch_batch
-- Steps 1 and 2 in one statement, once a batch was read from a range (store.Fetching.batch):
-- the ids fetch_deliverable chooses (its text goes in the braces below), each message read by
-- primary key from the range of `message` the relay's last batch was read from (named in
-- the braces below), on a plan made once that locks that range alone. A row whose message
-- is not there (the ids moved on to the next range, or retention moved the row to the
-- default partition) comes with a NULL topic, and the relay reads the batch's ids again
-- with read_deliverable. The byte budget is read_deliverable's, over the messages found.
SELECT id, topic, key, header_keys, header_values, payload, content_type
FROM (
    SELECT i.message_id AS id, m.topic, m.key, m.header_keys, m.header_values, m.payload,
           m.content_type,
           sum(octet_length(m.payload)) OVER (ORDER BY i.message_id ROWS UNBOUNDED PRECEDING)
           AS bytes_so_far
    FROM ({fetch_deliverable}) AS i
    LEFT JOIN LATERAL (
        SELECT m.topic, m.key, m.header_keys, m.header_values, m.payload, m.content_type
        FROM {schema}.{range} AS m
        WHERE m.id = i.message_id
        OFFSET 0
    ) AS m ON true
) AS batch
WHERE coalesce(bytes_so_far - octet_length(payload), 0) < :max_bytes
ORDER BY id;

-- name: message_ranges
-- The range partitions of ``message``, by their lowest id (the first from the lowest id
-- there is), for the relay's reads of a batch's messages from its range (store.Fetching).
SELECT b.name, coalesce(b.low, -9223372036854775808) AS low, b.high
FROM {schema}.partition_bounds('{schema}.message') AS b
ORDER BY 2;

-- name: promote_due
-- Delayed rows whose time has come become PENDING; returns how many, and the seconds until
-- the next one is due (NULL when none is waiting). A due row another transaction holds (the
-- application deciding it, in a transaction still open) is skipped, not waited for: the
-- relay's loop would stall with it. It is looked at again in a second.
WITH due AS (
    SELECT message_id FROM {schema}.pending
    WHERE status = 'DELAYED' AND deliver_after <= now()
      AND shard = ANY(CAST(:shards AS smallint[]))
    FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE {schema}.pending AS p SET status = 'PENDING'
    FROM due WHERE p.message_id = due.message_id
    RETURNING p.message_id
)
SELECT (SELECT count(*) FROM promoted) AS promoted,
       CASE WHEN EXISTS (SELECT FROM {schema}.pending AS p
                         WHERE p.status = 'DELAYED' AND p.deliver_after <= now()
                           AND p.shard = ANY(CAST(:shards AS smallint[]))
                           AND p.message_id NOT IN (SELECT message_id FROM promoted))
            THEN 1.0
            ELSE (SELECT extract(epoch FROM min(deliver_after) - now()) FROM {schema}.pending
                  WHERE status = 'DELAYED' AND deliver_after > now()
                    AND shard = ANY(CAST(:shards AS smallint[]))) END AS next_due_in;

-- name: mark_delivered
-- Close a delivered batch in one statement: the pending rows are deleted (the message rows
-- are not touched) and each gets a DELIVERED op record with the partition and offset Kafka
-- acknowledged. A row another relay already closed is left alone. Returns each row's
-- publish-to-ack latency (database clock: the op record's time minus the prepare row's).
-- The rows are deleted by key (= ANY walks the primary key: the cost follows the batch);
-- joined with the acks as a set, the planner hash-joined them with every pending row, 10 ms
-- a batch at a 50,000-message backlog.
-- The recorder runs it with enable_seqscan off (store.engine): pending's statistics lie.
WITH delivered AS (
    DELETE FROM {schema}.pending AS p
    WHERE p.message_id = ANY(CAST(:ids AS bigint[])) AND p.status = 'PENDING'
    RETURNING p.message_id, p.topic, p.created_at
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, kafka_partition, kafka_offset)
    SELECT d.message_id, 'DELIVERED', :actor, a.kafka_partition, a.kafka_offset
    FROM delivered AS d
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:partitions AS integer[]),
                CAST(:offsets AS bigint[])) AS a(id, kafka_partition, kafka_offset)
      ON a.id = d.message_id
)
SELECT topic, CAST(extract(epoch FROM clock_timestamp() - created_at) AS double precision)
       AS latency
FROM delivered;

-- name: unrecorded_candidates
-- The messages of :shards that a previous owner (or a failed pass of this relay) may have
-- sent without recording, per topic and key: the earliest moment one of them can have been
-- sent (after its commit, after it fell due if it was delayed, and after its shard was last
-- settled; greatest() skips a NULL). Held rows too: a held topic's rows may have been sent
-- before Kafka refused it.
SELECT p.topic, p.key, min(greatest(p.created_at, p.deliver_after, l.settled_at)) AS sent_after
FROM {schema}.pending AS p
JOIN {schema}.relay_lease AS l ON l.shard = p.shard
WHERE p.status = 'PENDING' AND p.resolution = 'COMMIT'
  AND p.shard = ANY(CAST(:shards AS smallint[]))
GROUP BY p.topic, p.key;

-- name: doubted_candidates
-- The same of the messages :ids, sent by a pass of this relay that failed before it
-- recorded them, if still pending. Reads them by primary key.
SELECT p.topic, p.key, min(greatest(p.created_at, p.deliver_after, l.settled_at)) AS sent_after
FROM {schema}.pending AS p
JOIN {schema}.relay_lease AS l ON l.shard = p.shard
WHERE p.message_id = ANY(CAST(:ids AS bigint[]))
  AND p.status = 'PENDING' AND p.resolution = 'COMMIT'
GROUP BY p.topic, p.key;

-- name: recorded_offsets
-- Per partition of :topics (element by element with :partitions, :sinces and :befores), the
-- highest offset of a DELIVERED op record written in [its since, its before): each was
-- written after Kafka acknowledged it, so a message sent after that before landed above it.
-- Walks op_record_created_at_idx (BRIN) over [:since, :before), the windows' union, once
-- for them all (one statement per topic read it once a topic: 2,000 topics new to the
-- relay, each without a record, took 40 s).
SELECT w.topic, w.partition, max(o.kafka_offset) AS kafka_offset
FROM {schema}.op_record AS o
CROSS JOIN LATERAL (  -- by key, one partition each (see fetch_deliverable)
    SELECT m.topic FROM {schema}.message AS m WHERE m.id = o.message_id OFFSET 0) AS m
JOIN unnest(CAST(:topics AS text[]), CAST(:partitions AS integer[]),
            CAST(:sinces AS timestamptz[]), CAST(:befores AS timestamptz[]))
     AS w(topic, partition, since, before)
  ON w.topic = m.topic AND w.partition = o.kafka_partition
 AND o.created_at >= w.since AND o.created_at < w.before
WHERE o.action = 'DELIVERED' AND o.created_at >= :since AND o.created_at < :before
GROUP BY w.topic, w.partition;

-- name: pending_in_shards
-- Of the ids found in a topic's tail, those still pending in shards this relay holds a live
-- lease on (another relay's messages on the same partitions are left to it), with what a
-- record of each must carry besides its id (relay/tails.py: another outbox's ids are alike).
SELECT p.message_id, p.topic, p.key, sha256(m.payload) AS digest
FROM {schema}.pending AS p
JOIN {schema}.relay_lease AS l ON l.shard = p.shard
CROSS JOIN LATERAL (  -- by primary key, one partition each (see fetch_deliverable)
    SELECT m.payload FROM {schema}.message AS m WHERE m.id = p.message_id OFFSET 0) AS m
WHERE p.message_id = ANY(CAST(:ids AS bigint[])) AND p.status = 'PENDING'
  AND p.shard = ANY(CAST(:shards AS smallint[]))
  AND l.owner = :worker_id AND l.expires_at > now();

-- name: record_failures
-- Keep the broker's reason for each failed send and count the permanent rejections
-- (`attempts`): a row rejected permanently :max_attempts times is PARKED with an op record, so
-- it never blocks the relay again. Retriable failures (a broker away, a request timed out)
-- are not counted: they say nothing about the message.
WITH failed AS (
    UPDATE {schema}.pending AS m
    SET attempts = m.attempts + CASE WHEN f.permanent THEN 1 ELSE 0 END, last_error = f.error,
        status = CASE WHEN f.permanent AND m.attempts + 1 >= :max_attempts
                      THEN 'PARKED' ELSE m.status END
    FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[]),
                CAST(:permanent AS boolean[])) AS f(id, error, permanent)
    WHERE m.message_id = f.id AND m.status = 'PENDING'
      AND m.message_id = ANY(CAST(:ids AS bigint[]))  -- by key (see mark_delivered)
    RETURNING m.message_id AS id, m.topic, m.status, f.error
), parked AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT id, 'PARKED', :actor, error FROM failed WHERE status = 'PARKED'
)
SELECT id, topic, status FROM failed;

-- name: mark_held
-- Held topics' waiting rows say so (last_error starting with 'held: '), for `outbox status`,
-- and are flagged `held`, out of the fetch's walk: at most :limit rows (relay/holds.py writes
-- the rest in its next steps), found along pending_relay_idx, which flagged rows have left
-- (a scan of the table read every held row again at each step), written by primary key
-- (`= ANY(ARRAY(...))`: joined as a set, the planner read the whole table for them, 40 ms
-- of a 160 ms step at 220,000 pending rows; the same in the three statements below). Every
-- topic held or asked about again in one step in one statement: one per topic read the
-- shards' rows once per topic. Returns how many were flagged.
WITH due AS (
    SELECT p.message_id, h.reason
    FROM {schema}.pending AS p
    JOIN unnest(CAST(:topics AS text[]), CAST(:reasons AS text[])) AS h (topic, reason)
      ON p.topic = h.topic
    WHERE p.status = 'PENDING' AND p.resolution = 'COMMIT' AND NOT p.held
      AND p.shard = ANY(CAST(:shards AS smallint[]))
    ORDER BY p.message_id  -- with the relay's enable_sort off: a walk of pending_relay_idx
    LIMIT :limit
), flagged AS (
    UPDATE {schema}.pending AS p SET last_error = due.reason, held = true
    FROM due
    WHERE p.message_id = due.message_id
      AND p.message_id = ANY(ARRAY(SELECT message_id FROM due))
    RETURNING 1
)
SELECT count(*) FROM flagged;

-- name: release_held
-- Held topics released (Kafka knows them now, or takes their records): at most :limit of
-- their rows in :shards rejoin the fetch's walk (relay/holds.py releases the rest in its
-- next steps: a row behind a held one of its key waits for it). Their 'held: ' notes stay
-- until they are sent. Returns how many.
WITH released AS (
    UPDATE {schema}.pending SET held = false
    WHERE message_id = ANY(ARRAY(
        SELECT message_id FROM {schema}.pending
        WHERE held AND topic = ANY(CAST(:topics AS text[]))
          AND shard = ANY(CAST(:shards AS smallint[]))
        LIMIT :limit))
    RETURNING 1
)
SELECT count(*) FROM released;

-- name: renote_held
-- A held topic's reason changed (Kafka stopped describing it to the relay, or started
-- again): at most :limit of its flagged rows in :shards past the cursor (:after_shard,
-- :after_id: the last row the step before noted, in pending_held_idx's order) say the new
-- one, for `outbox status` (relay/holds.py notes the rest in its next steps). Returns how
-- many, and the last one's shard and id.
WITH noted AS (
    UPDATE {schema}.pending SET last_error = :reason
    WHERE message_id = ANY(ARRAY(
        SELECT message_id FROM {schema}.pending
        WHERE held AND topic = :topic AND (shard, message_id) > (:after_shard, :after_id)
          AND shard = ANY(CAST(:shards AS smallint[])) AND last_error IS DISTINCT FROM :reason
        ORDER BY shard, message_id
        LIMIT :limit))
    RETURNING shard, message_id
)
SELECT count(*) AS rows, max(ARRAY[shard, message_id]) AS last FROM noted;

-- name: try_held
-- Refused topics tried again (relay/holds.py): per shard of :shards, the first of each one's
-- held rows the fetch would send rejoins its walk: not one held back by an earlier row of
-- its key (held_back, the fetch's test), which would send nothing from the shard and leave
-- the trial unanswered for its 60 s. Its key's later rows stay behind it.
UPDATE {schema}.pending SET held = false
WHERE message_id = ANY(ARRAY(
    SELECT first.message_id
    FROM unnest(CAST(:topics AS text[])) AS t (topic)
    CROSS JOIN unnest(CAST(:shards AS smallint[])) AS s (shard)
    CROSS JOIN LATERAL (
        SELECT p.message_id FROM {schema}.pending AS p
        WHERE p.held AND p.topic = t.topic AND p.shard = s.shard AND p.status = 'PENDING'
          AND NOT {held_back}
        ORDER BY p.message_id LIMIT 1) AS first));

-- name: flagged_topics
-- Topics with rows of :shards flagged held that this relay neither holds nor tries nor is
-- releasing (:kept): flagged by a relay that stopped or lost the shard since (relay/holds.py
-- asks Kafka about them, then holds or tries them), each with the note of one of its rows
-- there (the hold's reason, which says since when). The flagged topics are found by skipping
-- along pending_held_idx, and each is looked for in :shards, one probe each, so a topic held
-- with a million rows costs two. Each probe is a subquery with ORDER BY or LIMIT, not min()
-- or EXISTS: right after a million rows were flagged, before autovacuum's ANALYZE, the
-- planner took the index for nearly empty and read all of it, for min() and again for
-- EXISTS as a hashed semi-join (2.5 s where the probes take well under 1 ms).
WITH RECURSIVE flagged (topic) AS (
    (SELECT topic FROM {schema}.pending WHERE held ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT n.topic FROM {schema}.pending AS n WHERE n.held AND n.topic > f.topic
            ORDER BY n.topic LIMIT 1)
    FROM flagged AS f WHERE f.topic IS NOT NULL
)
SELECT f.topic, one.last_error AS note
FROM flagged AS f
CROSS JOIN LATERAL (
    SELECT n.last_error FROM {schema}.pending AS n
    WHERE n.held AND n.topic = f.topic AND n.shard = ANY(CAST(:shards AS smallint[]))
    LIMIT 1) AS one
WHERE f.topic IS NOT NULL AND f.topic <> ALL(CAST(:kept AS text[]))
ORDER BY f.topic;

-- name: park_topic
-- A topic held longer than OUTBOX_TOPIC_HOLD_PARK_AFTER: at most :limit of its waiting rows
-- in :shards are PARKED with the reason and an op record each, like a permanently rejected
-- message (relay/holds.py parks the rest in its next steps: a million rows in one statement
-- held the relay's loop for 20 s). Its flagged rows first, along pending_held_idx, then
-- those not flagged yet, along pending_relay_idx, which parked rows leave. Returns how many.
WITH due AS (
    (SELECT message_id FROM {schema}.pending
     WHERE held AND topic = :topic AND shard = ANY(CAST(:shards AS smallint[]))
     LIMIT :limit)
    UNION ALL
    (SELECT message_id FROM {schema}.pending
     WHERE status = 'PENDING' AND resolution = 'COMMIT' AND NOT held AND topic = :topic
       AND shard = ANY(CAST(:shards AS smallint[]))
     ORDER BY message_id  -- with the relay's enable_sort off: a walk of pending_relay_idx
     LIMIT :limit)
    LIMIT :limit
), parked AS (
    UPDATE {schema}.pending SET status = 'PARKED', last_error = :reason, held = false
    WHERE message_id = ANY(ARRAY(SELECT message_id FROM due))
      AND status = 'PENDING' AND resolution = 'COMMIT'
    RETURNING message_id
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT message_id, 'PARKED', :actor, :reason FROM parked
    RETURNING 1
)
SELECT count(*) FROM recorded;

-- name: lock_migrations
-- Migrations of one schema take turns: held until the migrating transaction ends. Then each
-- statement waits :lock_timeout at most for a table's lock: while one waits, every reader and
-- writer of that table queues behind it.
SELECT pg_advisory_xact_lock(:lock_class, hashtext(:schema_name)),
       set_config('lock_timeout', :lock_timeout, true);

-- name: lock_holders
-- The oldest transactions holding locks on the schema's tables: who a migration waited for.
SELECT a.pid, a.usename AS role, a.application_name, a.state,
       extract(epoch FROM now() - a.xact_start) AS seconds, left(a.query, 80) AS query
FROM pg_stat_activity AS a
WHERE a.pid <> pg_backend_pid() AND a.pid IN (
    SELECT l.pid FROM pg_locks AS l
    JOIN pg_class AS c ON c.oid = l.relation
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = :schema_name AND l.granted)
ORDER BY a.xact_start
LIMIT 3;

-- name: claim_worker_id
-- A relay holds a session advisory lock on (schema, worker id) for as long as it runs, on a
-- connection of its own: a second live process with the same id cannot take it and is
-- refused; a dead one's lock goes with its connection (kill -9 included).
SELECT pg_try_advisory_lock(:lock_class, hashtext(:schema_name || '/' || :worker_id));

-- name: release_worker_id
SELECT pg_advisory_unlock(:lock_class, hashtext(:schema_name || '/' || :worker_id));

-- name: end_lost_sessions
-- The sessions a relay opened under its worker-id lock connection's name (unique to the
-- process) other than this one. A connection lost without the server hearing of it (a silent
-- network drop) leaves its session running, holding the worker-id lock, until the server's
-- own keepalives end it (two hours by default): the relay that took its id again would be
-- refused as its own twin. Ends them; the lock goes with them.
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity
WHERE application_name = :session_name AND pid <> pg_backend_pid();

-- name: fall_asleep
-- A relay with nothing to deliver takes the wake lock of each shard it delivers (session
-- locks on its LISTEN connection; they go with it), so that publishers of those shards
-- notify from now on. Taking one waits (at most the connection's lock_timeout) for the
-- publishers that hold it shared: they did not notify, so the relay fetches once more after
-- they commit, and only then waits for notifications.
SELECT count(pg_advisory_lock(:wake_class, :wake_base + shard))
FROM unnest(CAST(:shards AS integer[])) AS shard;

-- name: rise
-- A relay delivering again lets go of its wake locks: publishers stop notifying.
SELECT pg_advisory_unlock_all();

-- name: heartbeat
-- A relay says it is alive, how many messages it has in flight and whether it is paused
-- (:paused_seconds NULL when not), and forgets relays silent for ten lease lengths. Returns
-- whether it just joined.
WITH gone AS (
    DELETE FROM {schema}.relay_member
    WHERE seen_at < now() - make_interval(secs => :lease_seconds * 10)
)
INSERT INTO {schema}.relay_member (worker_id, seen_at, in_flight, paused_since, paused_reason)
VALUES (:worker_id, now(), :in_flight,
        now() - make_interval(secs => CAST(:paused_seconds AS double precision)),
        :paused_reason)
ON CONFLICT (worker_id) DO UPDATE
SET seen_at = now(), in_flight = EXCLUDED.in_flight,
    paused_since = EXCLUDED.paused_since, paused_reason = EXCLUDED.paused_reason
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
-- Returns whether each was handed back clean; a shard taken clean is settled from now on,
-- one taken from a dead owner keeps its settled_at (its tail is read before sending).
WITH taken AS (
    SELECT shard, clean FROM {schema}.relay_lease
    WHERE owner IS NULL OR expires_at < now()
    ORDER BY shard
    LIMIT :wanted
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.relay_lease AS l
SET owner = :worker_id, expires_at = now() + make_interval(secs => :lease_seconds),
    clean = false, settled_at = CASE WHEN t.clean THEN now() ELSE l.settled_at END
FROM taken AS t
WHERE l.shard = t.shard
RETURNING l.shard, t.clean AS was_clean;

-- name: settle_leases
-- After its tail was read: every message of these shards sent so far is recorded.
UPDATE {schema}.relay_lease SET settled_at = now()
WHERE owner = :worker_id AND shard = ANY(CAST(:shards AS smallint[]));

-- name: release_leases
-- Hand shards back and tell the other relays, so one claims them at once. Clean unless
-- :unsettled names the shard (a send of it may be unrecorded: the next owner reads the tail).
WITH released AS (
    UPDATE {schema}.relay_lease
    SET owner = NULL, expires_at = NULL,
        clean = NOT shard = ANY(CAST(:unsettled AS smallint[]))
    WHERE owner = :worker_id AND shard = ANY(CAST(:shards AS smallint[]))
)
SELECT pg_notify(:channel, 'rebalance');

-- name: leave
-- A relay stopping gracefully hands all its shards back at once and tells the others (clean
-- as in release_leases).
WITH released AS (
    UPDATE {schema}.relay_lease
    SET owner = NULL, expires_at = NULL,
        clean = NOT shard = ANY(CAST(:unsettled AS smallint[]))
    WHERE owner = :worker_id
), gone AS (
    DELETE FROM {schema}.relay_member WHERE worker_id = :worker_id
)
SELECT pg_notify(:channel, 'rebalance');

-- name: abandon_leases
-- A relay stopping without waiting for its sends (a second signal, its stop timeout) keeps
-- its shards only until a send it made can no longer land: :grace_seconds from now (its
-- producer, closed, sends nothing more), or sooner if the lease ends sooner. Not clean: the
-- next owner reads the tails first. It leaves the relays' list and tells the others, whose
-- keepers claim the shards as the leases end (next_lease_expiry). Returns how many it held.
WITH abandoned AS (
    UPDATE {schema}.relay_lease
    SET expires_at = LEAST(expires_at, now() + make_interval(secs => :grace_seconds)),
        clean = false
    WHERE owner = :worker_id
    RETURNING shard
), gone AS (
    DELETE FROM {schema}.relay_member WHERE worker_id = :worker_id
)
SELECT (SELECT count(*) FROM abandoned) AS shards, pg_notify(:channel, 'rebalance');

-- name: next_lease_expiry
-- Seconds until the first lease of another relay ends (NULL: none is held): one that relay
-- no longer renews (abandoned, or it died) is claimed then, not at the keeper's next tick.
SELECT extract(epoch FROM min(expires_at) - now()) FROM {schema}.relay_lease
WHERE owner <> :worker_id;

-- name: resume
-- Re-queue PARKED rows for delivery and re-arm the check-backs of DISCARDED rows
-- (RocketMQ's RESUME_CHECK_HALF_MESSAGE); each gets a RESUMED op record.
WITH resumed AS (
    UPDATE {schema}.pending AS m
    SET status = CASE WHEN m.deliver_after > now() THEN 'DELAYED' ELSE 'PENDING' END,
        attempts = 0, last_error = NULL,
        check_count = CASE WHEN old.status = 'DISCARDED' THEN 0 ELSE m.check_count END,
        next_check_at = CASE WHEN old.status = 'DISCARDED' THEN now() ELSE m.next_check_at END
    FROM {schema}.pending AS old
    WHERE old.message_id = m.message_id AND m.status IN ('PARKED', 'DISCARDED')
      AND (m.message_id = ANY(CAST(:ids AS bigint[])) OR CAST(:all AS boolean))
    RETURNING m.message_id, old.status AS was
)
INSERT INTO {schema}.op_record (message_id, action, actor, detail)
SELECT message_id, 'RESUMED', :actor, 'was ' || was FROM resumed
RETURNING message_id, detail, pg_notify(:channel, '');

-- name: backlog
-- Undelivered messages by state for the metrics (the pending table holds exactly those), and
-- how long the oldest committed one has waited (NULL when none waits).
SELECT count(*) FILTER (WHERE status = 'PENDING' AND resolution = 'COMMIT') AS pending,
       count(*) FILTER (WHERE resolution = 'UNKNOWN'
                        AND status IN ('PENDING', 'DELAYED')) AS unresolved,
       count(*) FILTER (WHERE status = 'DELAYED') AS delayed,
       count(*) FILTER (WHERE status = 'PARKED') AS parked,
       count(*) FILTER (WHERE status = 'DISCARDED') AS discarded,
       extract(epoch FROM now() - min(created_at) FILTER (
           WHERE status = 'PENDING' AND resolution = 'COMMIT')) AS oldest_pending_seconds
FROM {schema}.pending;

-- name: status_by_topic
-- What `outbox status` shows per topic. Only the pending table (what is not finished) and
-- the last minute of op records are read, so it stays cheap on a long history.
WITH counts AS (
    SELECT topic,
           count(*) FILTER (WHERE status = 'PENDING' AND resolution = 'COMMIT') AS pending,
           count(*) FILTER (WHERE resolution = 'UNKNOWN'
                            AND status IN ('PENDING', 'DELAYED')) AS unresolved,
           count(*) FILTER (WHERE status = 'DELAYED' AND resolution <> 'UNKNOWN') AS delayed,
           count(*) FILTER (WHERE status = 'PARKED') AS parked,
           count(*) FILTER (WHERE status = 'DISCARDED') AS discarded,
           count(*) FILTER (WHERE status = 'PENDING' AND last_error LIKE 'held: %') AS held,
           substr(min(last_error) FILTER (WHERE status = 'PENDING'
                                          AND last_error LIKE 'held: %'), 7) AS held_reason,
           extract(epoch FROM now() - min(created_at) FILTER (
               WHERE status IN ('PENDING', 'DELAYED'))) AS oldest_undelivered_seconds
    FROM {schema}.pending GROUP BY topic
), recent AS (
    SELECT m.topic, count(*) AS delivered_last_minute
    FROM {schema}.op_record AS o
    CROSS JOIN LATERAL (  -- by key, one partition each (see fetch_deliverable)
        SELECT m.topic FROM {schema}.message AS m WHERE m.id = o.message_id OFFSET 0) AS m
    WHERE o.action = 'DELIVERED' AND o.created_at > now() - interval '1 minute'
    GROUP BY m.topic
)
SELECT coalesce(c.topic, r.topic) AS topic,
       coalesce(c.pending, 0) AS pending, coalesce(c.unresolved, 0) AS unresolved,
       coalesce(c.delayed, 0) AS delayed, coalesce(c.parked, 0) AS parked,
       coalesce(c.discarded, 0) AS discarded, coalesce(c.held, 0) AS held, c.held_reason,
       coalesce(r.delivered_last_minute, 0) AS delivered_last_minute,
       c.oldest_undelivered_seconds
FROM counts AS c FULL JOIN recent AS r ON r.topic = c.topic
ORDER BY 1;

-- name: relays
-- The live relays, their shards, the messages they have in flight and, while one is paused,
-- for how long and why. Live: seen within :lease_seconds (the reader's setting), or holding
-- a lease not expired, for a relay given a longer lease beats less often (it was counted
-- alive and dead in turn by `outbox status`).
SELECT r.worker_id, r.in_flight, extract(epoch FROM now() - r.seen_at) AS seen_seconds_ago,
       extract(epoch FROM now() - r.paused_since) AS paused_seconds, r.paused_reason,
       l.shards
FROM {schema}.relay_member AS r
CROSS JOIN LATERAL (
    SELECT count(*) AS shards FROM {schema}.relay_lease AS l
    WHERE l.owner = r.worker_id AND l.expires_at > now()) AS l
WHERE r.seen_at > now() - make_interval(secs => :lease_seconds) OR l.shards > 0
ORDER BY r.worker_id;

-- name: ensure_partitions
-- Retention, step 1: ``message`` and ``op_record`` are partitioned by ranges of message id
-- (revision 0006); create the next :ahead ranges of :size ids beyond the sequence, so
-- publishes land in a range partition (the default partition takes them otherwise). Runs
-- the owner's SECURITY DEFINER function: the relay's role needs no rights on partitions (it
-- grants that role SELECT on each new range of message, for store.Fetching). It attaches
-- new, empty tables (no lock that stops publishers) and gives up after 500 ms of waiting
-- for a lock, until the next pass. Returns how many ranges it made.
SELECT {schema}.ensure_partitions(:size, :ahead) AS made;

-- name: written_span
-- How many ids the ranges of history hold and over how long: from the first message of the
-- oldest range to the newest message (each read by key; once a pass, so planning over every
-- partition is fine). No row when nothing is written.
SELECT newest.id - oldest.id AS ids,
       extract(epoch FROM newest.created_at - oldest.created_at) AS seconds
FROM (SELECT m.id, m.created_at FROM {schema}.message AS m
      WHERE m.id >= (SELECT coalesce(min(coalesce(b.low, -9223372036854775808)),
                                     -9223372036854775808)
                     FROM {schema}.partition_bounds('{schema}.message') AS b)
      ORDER BY m.id LIMIT 1) AS oldest,
     (SELECT m.id, m.created_at FROM {schema}.message AS m ORDER BY m.id DESC LIMIT 1) AS newest;

-- name: history_ranges
-- Every range partition of ``message`` and ``op_record`` (the catalog's list), by name.
SELECT b.name FROM {schema}.partition_bounds('{schema}.message') AS b
UNION ALL
SELECT b.name FROM {schema}.partition_bounds('{schema}.op_record') AS b
ORDER BY 1;

-- name: tend_range
-- Retention, step 4 (the pass's last): statistics and BRIN summaries for one range, which
-- autovacuum leaves alone (revision 0011): without them every read of a window of history
-- read every range.
-- Returns what it did: untouched, summarized, analyzed, busy (locked by someone else), or
-- gone (another relay's pass dropped it since the list was read; revision 0012).
SELECT {schema}.tend_range(:name);

-- name: drop_expired_partition
-- Retention, step 2: drop the oldest range partition of ``message`` (with its op records'
-- partition) whose every id is handed out and whose every row is older than the window: a
-- catalog change, whatever the rows. Its unfinished messages (a pending row) and their op
-- records first move to the default partitions. Returns the partition dropped, or no row.
SELECT name, low, high, kept FROM {schema}.drop_expired_partition(:retention_seconds);

-- name: prune_default
-- Retention, step 3: delete up to :limit finished messages (no pending row) of the default
-- partition older than the window, with their op records (the default partition holds only
-- moved unfinished messages and rows published while no range partition covered them).
SELECT messages, op_records FROM {schema}.prune_default(:retention_seconds, :limit);

-- name: table_exists
SELECT to_regclass(:table) IS NOT NULL;

-- name: schema_version
SELECT version_num FROM {schema}.outbox_alembic_version;

-- name: read_only
SELECT current_setting('transaction_read_only')::boolean;

-- name: decide
-- An application's decision on an UNKNOWN message (RocketMQ's endTransaction), through the
-- SECURITY DEFINER function of revision 0005 (the application's role may not change pending
-- rows or write op records itself). It locks the pending row first, so the answer reflects a
-- decision that committed meanwhile; only an UNKNOWN row changes, so no decision or check-back
-- ever overrides an earlier one. COMMIT leaves the row to the relay; ROLLBACK deletes it with a
-- ROLLED_BACK op record; a DISCARDED row can still be decided (a late COMMIT is delivered, with
-- a RESUMED op record). Returns nothing for an unknown id, else the resolution found and
-- whether this call changed it.
SELECT was_resolution, decided, notified
FROM {schema}.decide_message(:id, CAST(:resolution AS text), :actor, :channel);

-- name: claim_checks
-- A sweeper claims due UNKNOWN rows of the producer groups it has checkers for, through the
-- partial index pending_check_idx (its cost follows the due rows, not the history). The
-- groups take turns, oldest due first within each: a backlog of one group's slow checks does
-- not hold back the others' (each group's first rows come before any group's second; the
-- rows locked past the :limit taken are let go at once, on commit). The claim pushes
-- next_check_at past the checker timeout: other sweepers skip the row until then, and a
-- crashed sweeper's claim simply expires. The new next_check_at is the claim's token: only
-- its holder may record the check's outcome (record_checks).
WITH due AS (
    SELECT d.message_id
    FROM unnest(CAST(:groups AS text[])) AS g(producer_group)
    CROSS JOIN LATERAL (
        SELECT message_id, next_check_at FROM {schema}.pending
        WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
          AND producer_group = g.producer_group AND next_check_at <= now()
        ORDER BY next_check_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ) AS d
    ORDER BY row_number() OVER (PARTITION BY g.producer_group ORDER BY d.next_check_at),
             d.next_check_at
    LIMIT :limit
)
UPDATE {schema}.pending AS p
SET next_check_at = now() + make_interval(secs => :claim_seconds)
FROM due, {schema}.message AS m
WHERE p.message_id = due.message_id AND m.id = p.message_id
RETURNING m.id, m.producer_group, m.topic, m.key, m.header_keys, m.header_values, m.payload,
          m.content_type, m.created_at, p.check_count, p.next_check_at AS token;

-- name: record_checks
-- Check-back outcomes, each recorded only while its claim holds (next_check_at = token)
-- and the row is still UNKNOWN: a decision, or a record that came first, always wins.
-- COMMIT leaves the row to the relay; ROLLBACK deletes it with an op record; an inconclusive
-- answer schedules the next check, or at the :check_max-th discards the row with an op
-- record (RocketMQ's TRANS_CHECK_MAX_TIME_TOPIC). Each but the reschedule wakes the relay:
-- a COMMIT is to deliver, and the others free the later messages of the key that waited
-- behind the row. Returns the rows it changed.
-- A row locked by an application's decision not yet committed is skipped, not waited for:
-- its decision wins if it commits, and if not, the claim lapses and the row is checked again
-- (the sweeper's main loop records timeouts here, and waited as long as the application).
-- :counted is 0 for COMMIT or ROLLBACK answers that came after their check's timeout was
-- counted: each decides its row if still UNKNOWN, claimed or not, as an application's
-- decision does (RocketMQ takes a producer's late answer the same way), and is not counted.
WITH unlocked AS (
    SELECT message_id FROM {schema}.pending
    WHERE message_id = ANY(CAST(:ids AS bigint[]))
    FOR UPDATE SKIP LOCKED
), outcome AS (
    SELECT o.* FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS timestamptz[]),
                           CAST(:resolutions AS text[]), CAST(:details AS text[]))
             AS o(id, token, resolution, detail)
    JOIN unlocked ON unlocked.message_id = o.id
), checked AS (
    UPDATE {schema}.pending AS p
    SET check_count = p.check_count + :counted,
        resolution = o.resolution,
        status = CASE WHEN o.resolution = 'UNKNOWN' AND p.check_count + 1 >= :check_max
                      THEN 'DISCARDED' ELSE p.status END,
        next_check_at = CASE WHEN o.resolution = 'UNKNOWN' AND p.check_count + 1 < :check_max
                             THEN now() + make_interval(secs => :check_interval) END
    FROM outcome AS o
    WHERE o.resolution <> 'ROLLBACK' AND p.message_id = o.id
      AND (p.next_check_at = o.token OR :counted = 0)
      AND p.message_id = ANY(CAST(:ids AS bigint[]))  -- by key (see mark_delivered)
      AND p.resolution = 'UNKNOWN' AND p.status IN ('PENDING', 'DELAYED')
    RETURNING p.message_id AS id, p.producer_group, p.resolution, p.status, p.check_count,
              o.detail
), rolled_back AS (
    DELETE FROM {schema}.pending AS p
    USING outcome AS o
    WHERE o.resolution = 'ROLLBACK' AND p.message_id = o.id
      AND (p.next_check_at = o.token OR :counted = 0)
      AND p.message_id = ANY(CAST(:ids AS bigint[]))
      AND p.resolution = 'UNKNOWN' AND p.status IN ('PENDING', 'DELAYED')
    RETURNING p.message_id AS id, p.producer_group, 'ROLLBACK' AS resolution,
              'ROLLED_BACK' AS status, p.check_count + :counted AS check_count, o.detail
), changed AS (
    SELECT * FROM checked UNION ALL SELECT * FROM rolled_back
), recorded AS (
    INSERT INTO {schema}.op_record (message_id, action, actor, detail)
    SELECT id, status, :actor,
           CASE WHEN status = 'ROLLED_BACK' THEN 'check-back ' || check_count || ': ' || detail
                WHEN check_count = 1 THEN '1 inconclusive check-back: ' || detail
                ELSE check_count || ' inconclusive check-backs, the last: ' || detail END
    FROM changed WHERE status IN ('ROLLED_BACK', 'DISCARDED')
)
SELECT id, producer_group, resolution, status, check_count,
       (SELECT count(pg_notify(:channel, '')) FROM changed
        WHERE (resolution = 'COMMIT' AND status = 'PENDING')
           OR status IN ('ROLLED_BACK', 'DISCARDED')) AS notified
FROM changed;

-- name: next_check_in
-- Seconds until the sweeper's next due row (NULL when none waits), from each group's first
-- entry in pending_check_idx.
SELECT extract(epoch FROM min(d.next_check_at) - now())
FROM unnest(CAST(:groups AS text[])) AS g(producer_group)
CROSS JOIN LATERAL (
    SELECT next_check_at FROM {schema}.pending
    WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
      AND producer_group = g.producer_group AND next_check_at IS NOT NULL
    ORDER BY next_check_at
    LIMIT 1
) AS d;

-- name: unchecked_groups
-- Due UNKNOWN rows of producer groups the sweeper has no checker for: reported, not counted.
SELECT producer_group, count(*) AS due FROM {schema}.pending
WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED') AND next_check_at <= now()
  AND producer_group <> ALL(CAST(:groups AS text[]))
GROUP BY producer_group
ORDER BY producer_group;

-- name: cut_off_after
-- The transaction's statements are cut off (QueryCanceled) after :timeout_ms.
SELECT set_config('statement_timeout', :timeout_ms, true);

-- name: begin_check
-- A checker's transaction is read-only and its statements are cut off at the checker timeout;
-- the session ends if the transaction stays idle past :idle_ms (a Python checker stuck
-- outside any statement, whose thread cannot be stopped, would hold its snapshot for ever).
SELECT set_config('transaction_read_only', 'on', true),
       set_config('statement_timeout', :timeout_ms, true),
       set_config('idle_in_transaction_session_timeout', :idle_ms, true);

-- name: discarded
-- What `outbox discarded` lists: rows whose check-backs all stayed inconclusive.
SELECT p.message_id AS id, p.producer_group, p.topic, p.key, p.check_count, p.created_at,
       d.created_at AS discarded_at, d.detail
FROM {schema}.pending AS p
LEFT JOIN LATERAL (
    SELECT o.created_at, o.detail FROM {schema}.op_record AS o
    WHERE o.message_id = p.message_id AND o.action = 'DISCARDED'
    ORDER BY o.id DESC
    LIMIT 1
) AS d ON true
WHERE p.status = 'DISCARDED'
ORDER BY p.message_id
LIMIT :limit;

-- name: check_backlog
-- UNKNOWN messages per producer group for `outbox status`, through pending_check_idx. An
-- overdue one has waited for its check-back longer than a sweeper takes to claim it: no
-- running sweeper has a checker for its group, or the sweepers cannot keep up.
SELECT producer_group, count(*) AS unresolved,
       count(*) FILTER (WHERE next_check_at < now() - make_interval(secs => :overdue_seconds))
       AS overdue
FROM {schema}.pending
WHERE resolution = 'UNKNOWN' AND status IN ('PENDING', 'DELAYED')
GROUP BY producer_group
ORDER BY producer_group;

-- name: console_overreach
-- Whether the console's role may do more than <schema>_console grants (delete messages or
-- pending rows, as an owner or superuser can): the console then warns at start.
SELECT current_user AS role,
       has_table_privilege('{schema}.message', 'DELETE')
           OR has_table_privilege('{schema}.pending', 'DELETE') AS overreaches;

-- name: begin_snapshot
-- The console reads its whole page from one read-only snapshot, so its numbers agree.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: held_messages
-- The console's list of PARKED and DISCARDED messages (kept for an operator), optionally of one
-- topic and one key, newest first, with why (the broker's last error, or the op record that
-- discarded the row) and at most :preview_bytes of the payload. The pending table holds only
-- unfinished messages, so this reads no history; payloads are read by primary key.
SELECT p.message_id AS id, p.status, p.producer_group, p.topic, p.key, p.check_count,
       p.attempts, p.created_at, coalesce(p.last_error, d.detail) AS reason,
       octet_length(m.payload) AS payload_bytes,
       substring(m.payload FROM 1 FOR :preview_bytes) AS preview, m.content_type
FROM {schema}.pending AS p
CROSS JOIN LATERAL (  -- by key, one partition each (see fetch_deliverable)
    SELECT m.payload, m.content_type FROM {schema}.message AS m
    WHERE m.id = p.message_id OFFSET 0) AS m
LEFT JOIN LATERAL (
    SELECT o.detail FROM {schema}.op_record AS o
    WHERE o.message_id = p.message_id AND o.action = p.status
    ORDER BY o.id DESC
    LIMIT 1
) AS d ON true
WHERE p.status IN ('PARKED', 'DISCARDED')
  AND (CAST(:topic AS text) IS NULL OR p.topic = :topic)
  AND (CAST(:key AS bytea) IS NULL OR p.key = :key)
ORDER BY p.message_id DESC
LIMIT :limit;

-- name: delivery_history
-- Deliveries since the start of the minute :window_seconds ago, per minute and (the row whose
-- minute is NULL) in all: how many, and percentiles of the publish-to-ack latency (the
-- DELIVERED op record's time minus the prepare row's). Walks op_record's BRIN index on
-- created_at, so it reads the window, not the history; message rows by primary key.
SELECT date_trunc('minute', o.created_at) AS minute, count(*) AS delivered,
       percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
           ORDER BY extract(epoch FROM o.created_at - m.created_at)) AS latency
FROM {schema}.op_record AS o
CROSS JOIN LATERAL (  -- by key, one partition each (see fetch_deliverable)
    SELECT m.created_at FROM {schema}.message AS m WHERE m.id = o.message_id OFFSET 0) AS m
WHERE o.action = 'DELIVERED'
  AND o.created_at >= date_trunc('minute', now() - make_interval(secs => :window_seconds))
GROUP BY GROUPING SETS ((date_trunc('minute', o.created_at)), ())
ORDER BY minute NULLS FIRST;

-- name: lease_owners
-- Who holds the shards: per owner (NULL: free or expired), the shards and the seconds until
-- the first of its leases expires (64 rows at most).
SELECT CASE WHEN expires_at > now() THEN owner END AS owner,
       array_agg(shard ORDER BY shard) AS shards,
       extract(epoch FROM min(expires_at) FILTER (WHERE expires_at > now()) - now())
           AS expires_in
FROM {schema}.relay_lease
GROUP BY 1
ORDER BY 1 NULLS LAST;

-- name: reconcile_runs
-- The newest reconciliation runs (or run :id), with outcome, findings and where their files are.
SELECT id, started_at, finished_at, window_since, window_until, read_topics, messages,
       op_records, kafka_records, findings, outcome, output_path
FROM {schema}.reconcile_run
WHERE CAST(:id AS bigint) IS NULL OR id = :id
ORDER BY id DESC
LIMIT :limit;

-- name: create_roles
-- Least-privilege group roles (NOLOGIN; grant them to your login roles):
--   {schema}_app      writes prepare rows through publish_message() and decides through
--                     decide_message() (revisions 0014 and 0005: no INSERT on the tables);
--                     reads no payloads, updates and deletes nothing;
--   {schema}_relay    delivers (delivery columns of pending, and the check columns `resume`
--                     re-arms), keeps leases, prunes through revision 0006's partition
--                     functions, and reads the ranges of message directly (SELECT on each,
--                     revision 0015; nothing else on partitions);
--   {schema}_sweeper  checks back (check columns of pending only; grant it SELECT on the
--                     tables your SQL checkers read);
--   {schema}_console  the operator console: reads what it shows and resumes (the resume
--                     query: delivery and check columns of pending, op records without a
--                     Kafka position); deletes nothing, writes no message, lease or run.
DO $roles$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['{schema}_app', '{schema}_relay', '{schema}_sweeper',
                                '{schema}_console'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name) THEN
            EXECUTE 'CREATE ROLE ' || quote_ident(name) || ' NOLOGIN';
        END IF;
    END LOOP;
END
$roles$;
-- Start from nothing, so running this again after an upgrade also takes back what an older
-- revision's rules granted.
REVOKE ALL ON ALL TABLES IN SCHEMA {schema}
    FROM {schema}_app, {schema}_relay, {schema}_sweeper, {schema}_console;
GRANT USAGE ON SCHEMA {schema}
    TO {schema}_app, {schema}_relay, {schema}_sweeper, {schema}_console;
GRANT SELECT ON {schema}.outbox_alembic_version
    TO {schema}_app, {schema}_relay, {schema}_sweeper, {schema}_console;
GRANT SELECT (id, producer_group, topic, key, shard, deliver_after, created_at)
    ON {schema}.message TO {schema}_app;
GRANT SELECT (message_id, status) ON {schema}.pending TO {schema}_app;
GRANT EXECUTE ON FUNCTION {schema}.publish_message,
                          {schema}.decide_message(bigint, text, text, text)
    TO {schema}_app;
GRANT SELECT ON {schema}.message TO {schema}_relay;
SELECT {schema}.grant_ranges();  -- and on each range of message
GRANT SELECT, DELETE, UPDATE (status, attempts, last_error, check_count, next_check_at, held)
    ON {schema}.pending TO {schema}_relay;
GRANT SELECT, INSERT ON {schema}.op_record TO {schema}_relay;
GRANT EXECUTE ON FUNCTION {schema}.ensure_partitions(bigint, integer),
                          {schema}.drop_expired_partition(double precision),
                          {schema}.prune_default(double precision, integer),
                          {schema}.tend_range(text)
    TO {schema}_relay;
GRANT SELECT, UPDATE ON {schema}.relay_lease TO {schema}_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.relay_member TO {schema}_relay;
GRANT SELECT ON {schema}.message TO {schema}_sweeper;
GRANT SELECT, DELETE, UPDATE (check_count, resolution, status, next_check_at)
    ON {schema}.pending TO {schema}_sweeper;
GRANT SELECT, INSERT ON {schema}.op_record TO {schema}_sweeper;
GRANT SELECT ON {schema}.message, {schema}.pending, {schema}.op_record, {schema}.relay_lease,
                {schema}.relay_member, {schema}.reconcile_run
    TO {schema}_console;
GRANT UPDATE (status, attempts, last_error, check_count, next_check_at)
    ON {schema}.pending TO {schema}_console;
GRANT INSERT (message_id, action, actor, detail) ON {schema}.op_record TO {schema}_console;

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

-- name: reconcile_role_sees_activity
-- Whether create_reconcile_role could make {schema}_reconcile a member of pg_read_all_stats.
SELECT pg_has_role('{schema}_reconcile', 'pg_read_all_stats', 'MEMBER');

-- name: create_checker_role
-- The SQL checkers' group role (NOLOGIN), {schema}_checker: granted nothing in the outbox
-- schema, it SELECTs only what the operator grants it on the business tables. The sweeper's
-- role is a member, so a checker is parsed with the checker's rights (sql_checker_as_checker).
-- It then runs inside run_sql_checker, a SECURITY DEFINER function the checker role owns:
-- there PostgreSQL refuses SET ROLE, RESET ROLE and set_config('role' or
-- 'session_authorization'), so a checker never gets the sweeper's (or a superuser's) rights
-- back. The function only EXECUTEs a statement the session prepared with the extended query
-- protocol, which PostgreSQL refuses to hold more than one statement. Owning a function needs
-- CREATE on its schema for a moment, taken back in the same transaction.
DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{schema}_checker') THEN
        CREATE ROLE {schema}_checker NOLOGIN;
    END IF;
    IF NOT pg_has_role('{schema}_checker', 'MEMBER') THEN
        GRANT {schema}_checker TO CURRENT_USER;  -- to make it the function's owner
    END IF;
END
$role$;
GRANT {schema}_checker TO {schema}_sweeper;
CREATE OR REPLACE FUNCTION {schema}.run_sql_checker(
    statement text, id bigint, producer_group text, topic text, key text, payload text,
    check_count integer
) RETURNS text LANGUAGE plpgsql SECURITY DEFINER AS $checker$
DECLARE
    answer text;
BEGIN
    EXECUTE 'EXECUTE ' || pg_catalog.quote_ident(statement) || '('
            || pg_catalog.concat_ws(', ', pg_catalog.quote_nullable(id),
                                    pg_catalog.quote_nullable(producer_group),
                                    pg_catalog.quote_nullable(topic),
                                    pg_catalog.quote_nullable(key),
                                    pg_catalog.quote_nullable(payload),
                                    pg_catalog.quote_nullable(check_count)) || ')'
        INTO answer;
    RETURN answer;
END
$checker$;
GRANT CREATE ON SCHEMA {schema} TO {schema}_checker;
ALTER FUNCTION {schema}.run_sql_checker(text, bigint, text, text, text, text, integer)
    OWNER TO {schema}_checker;
REVOKE CREATE ON SCHEMA {schema} FROM {schema}_checker;
REVOKE ALL ON FUNCTION {schema}.run_sql_checker(text, bigint, text, text, text, text, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION {schema}.run_sql_checker(text, bigint, text, text, text, text, integer)
    TO {schema}_sweeper;

-- name: sql_checker_as_checker
-- A SQL checker is parsed as the checker role: the names it reads resolve with its rights.
SET LOCAL ROLE {schema}_checker;

-- name: sql_checker_as_sweeper
SET LOCAL ROLE NONE;

-- name: plan_sql_checker
-- The plan of the SQL checker prepared for a check, as the checker role, unrun: PostgreSQL
-- checks its privileges (which preparing it does not), and its nodes show whether it would
-- lock or write rows, which its read-only check refuses (sql_checker_refusal).
EXPLAIN (FORMAT JSON) EXECUTE outbox_sql_checker(NULL, NULL, NULL, NULL, NULL, NULL);

-- name: sql_checker_ready
-- Whether `outbox db upgrade --create-roles` made the checker role and its function.
SELECT to_regrole('{schema}_checker') IS NOT NULL
       AND to_regprocedure('{schema}.run_sql_checker(text, bigint, text, text, text, text, '
                           'integer)') IS NOT NULL;

-- name: run_sql_checker
-- Run the statement prepared as :statement as the checker role (see create_checker_role).
SELECT {schema}.run_sql_checker(:statement, :id, :producer_group, :topic, :key, :payload,
                                :check_count);

-- name: reset_session
-- After a check: advisory locks, prepared statements and settings a checker left on its
-- connection's session are gone before the pool hands the connection out again.
DISCARD ALL;
