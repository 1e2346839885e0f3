-- leash 025: per-key concurrency and rate limits. A job may carry a concurrency_key (a customer,
-- a tenant, an account); a queue may set max_running_per_key: at most that many jobs of one key of the queue
-- hold the key at once across all workers. A job holds its key from its first start until it is
-- finished (completed, failed, cancelled): while it runs, and while it waits to run again (to
-- retry after an error, snoozed, handed back at shutdown, rescued after its worker died). With 1,
-- a key is sequential: the next job of a key starts only once the one before it has finished, in
-- the key's (priority, run_at, id) order. Jobs without a key are limited only by the queue's own
-- settings (pause, max_running).
-- How a claim keeps the limit: a queue with max_running_per_key is claimed as a capped queue is,
-- under its leash.queues row (FOR UPDATE SKIP LOCKED, one claim of the queue at a time across
-- all workers), in a READ COMMITTED transaction whose claim statement counts each key's holders
-- in a snapshot taken after the row was granted: exact, from the commit of the limit. The claim
-- does not walk the jobs of keys at their limit: leash.concurrency_keys holds one row per key
-- that has a job to claim, at the position (priority, run_at, id) of that job, and the claim
-- walks that table's index in order. Only claims (holding the queue's row) write it. Every other
-- change that may give a key something to claim (an insert, a job that stops running, a retry, a
-- changed run_at, priority, queue or key) appends the key to leash.key_wakes from a trigger, never
-- waiting on a lock; the next claim of the queue brings those keys' rows up to date.
-- Rate limits: a queue may set rate_limit and rate_period: at most rate_limit starts of its
-- jobs in any window of rate_period across all workers, kept exactly by a ring of start times
-- written by its claims under the queue's row (see leash.rate_room below).
-- leash:no-transaction
-- It runs outside a transaction because the two indexes on leash.jobs are built concurrently,
-- without blocking inserts or claims. Every statement is safe to repeat, so a run cut short is
-- simply run again.
-- Safe to apply while workers of the previous release run: it adds columns (NULL, no rewrite), a
-- check for new rows only, tables, indexes, functions and triggers those workers' statements do
-- not depend on; the triggers only append to leash.key_wakes, and only for jobs with a key in a
-- queue with a per-key limit, which no previous release writes; the check on leash.queues reads
-- its few rows, whose new columns are all NULL, and the trigger on it does nothing for a row
-- without a rate limit (as every row those workers create is). Those workers ignore the new
-- limits: a queue whose per-key limit or rate limit must hold needs every worker of this release.

ALTER TABLE leash.jobs ADD COLUMN IF NOT EXISTS concurrency_key text;

-- Empty is not a key (the Go API stores "" as NULL); a key is at most 1024 bytes, as a unique key.
-- Text cannot hold NUL. Checked for new and updated rows only: every existing row has none.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'jobs_concurrency_key_check'
                   AND conrelid = 'leash.jobs'::regclass) THEN
        ALTER TABLE leash.jobs ADD CONSTRAINT jobs_concurrency_key_check
            CHECK (concurrency_key IS NULL OR (concurrency_key <> '' AND octet_length(concurrency_key) <= 1024)) NOT VALID;
    END IF;
END;
$$;

ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS max_running_per_key integer;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'queues_max_running_per_key_check'
                   AND conrelid = 'leash.queues'::regclass) THEN
        ALTER TABLE leash.queues ADD CONSTRAINT queues_max_running_per_key_check
            CHECK (max_running_per_key IS NULL OR max_running_per_key >= 0);
    END IF;
END;
$$;

-- Rate limits: at most rate_limit starts of the queue's jobs in any window of rate_period (NULL:
-- one second) across all workers; NULL rate_limit: none. 0 starts nothing. The ring of
-- leash.rate_slots holds rate_limit rows, so the limit is bounded.
ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS rate_limit integer;
ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS rate_period interval;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'queues_rate_limit_check'
                   AND conrelid = 'leash.queues'::regclass) THEN
        ALTER TABLE leash.queues ADD CONSTRAINT queues_rate_limit_check
            CHECK ((rate_limit IS NULL OR rate_limit BETWEEN 0 AND 1000000)
                   AND (rate_period IS NULL OR rate_period BETWEEN interval '1 millisecond' AND interval '31 days'));
    END IF;
END;
$$;

-- The keys of a queue that have a job to claim, one row each, at the position of the first such
-- job: a job of the key that holds it and is waiting to run again, else, while the key has
-- room, its first job not yet started. Due positions come first; a key whose jobs are all
-- scheduled later is at the earliest of them. Written by claims only (each holding its queue's
-- row), so its rows are never waited for; nobody else needs to read it.
CREATE TABLE IF NOT EXISTS leash.concurrency_keys (
    queue         text        NOT NULL,
    key           text        NOT NULL,
    next_priority smallint    NOT NULL,
    next_run_at   timestamptz NOT NULL,
    next_id       bigint      NOT NULL,
    PRIMARY KEY (queue, key)
);

CREATE INDEX IF NOT EXISTS concurrency_keys_next_idx
    ON leash.concurrency_keys (queue, next_priority, next_run_at, next_id);

REVOKE ALL ON leash.concurrency_keys FROM PUBLIC;

-- Keys whose row in leash.concurrency_keys may be out of date, appended by the triggers below and
-- consumed by the next claim of the queue (which deletes the entries it has seen, in the same
-- statement that brings the keys' rows up to date). Appending never waits: no unique index.
CREATE TABLE IF NOT EXISTS leash.key_wakes (
    queue text NOT NULL,
    key   text NOT NULL
);

CREATE INDEX IF NOT EXISTS key_wakes_queue_key_idx ON leash.key_wakes (queue, key);

REVOKE ALL ON leash.key_wakes FROM PUBLIC;

-- A key's waiting jobs in its order, and the jobs that hold it (running, or started and waiting
-- to run again). Partial: jobs without a key are in neither, so they cost nothing more.
-- A build cut short leaves an invalid index behind: only such a one is dropped and built again.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass('leash.jobs_key_queued_idx') AND NOT indisvalid) THEN
        ALTER INDEX leash.jobs_key_queued_idx RENAME TO jobs_key_queued_idx_invalid;
    END IF;
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass('leash.jobs_key_holders_idx') AND NOT indisvalid) THEN
        ALTER INDEX leash.jobs_key_holders_idx RENAME TO jobs_key_holders_idx_invalid;
    END IF;
END;
$$;

DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_key_queued_idx_invalid;
DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_key_holders_idx_invalid;

CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_key_queued_idx
    ON leash.jobs (queue, concurrency_key, priority, run_at, id)
    WHERE concurrency_key IS NOT NULL AND state IN ('available', 'retryable') AND attempted_at IS NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_key_holders_idx
    ON leash.jobs (queue, concurrency_key)
    WHERE concurrency_key IS NOT NULL
      AND (state = 'running' OR (state IN ('available', 'retryable') AND attempted_at IS NOT NULL));

-- Appends the old and the new key of a changed job to leash.key_wakes, each only when its queue
-- has a per-key limit. Runs with its owner's rights: whoever may write leash.jobs needs no right
-- on leash.key_wakes or leash.queues.
CREATE OR REPLACE FUNCTION leash.wake_concurrency_keys() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.concurrency_key IS NOT NULL THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT OLD.queue, OLD.concurrency_key
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = OLD.queue AND q.max_running_per_key IS NOT NULL);
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.concurrency_key IS NOT NULL
       AND (TG_OP = 'INSERT' OR NEW.queue IS DISTINCT FROM OLD.queue OR NEW.concurrency_key IS DISTINCT FROM OLD.concurrency_key) THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT NEW.queue, NEW.concurrency_key
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = NEW.queue AND q.max_running_per_key IS NOT NULL);
    END IF;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.wake_concurrency_keys() FROM PUBLIC;

-- An insert of a job with a key; any change that may give its key (old or new) something to claim
-- or take it away, except a claim's own (queued to running, which the claim accounts for):
-- renewals, progress and the claims themselves do not fire it; jobs without a key never do.
DROP TRIGGER IF EXISTS jobs_key_inserted ON leash.jobs;
CREATE TRIGGER jobs_key_inserted AFTER INSERT ON leash.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION leash.wake_concurrency_keys();

DROP TRIGGER IF EXISTS jobs_key_changed ON leash.jobs;
CREATE TRIGGER jobs_key_changed AFTER UPDATE ON leash.jobs
    FOR EACH ROW WHEN ((OLD.concurrency_key IS NOT NULL OR NEW.concurrency_key IS NOT NULL)
        AND NOT (OLD.state IN ('available', 'retryable') AND NEW.state = 'running'
                 AND OLD.queue = NEW.queue AND OLD.concurrency_key IS NOT DISTINCT FROM NEW.concurrency_key)
        AND (OLD.state, OLD.run_at, OLD.priority, OLD.queue, OLD.concurrency_key, OLD.attempted_at, OLD.revoked_at)
            IS DISTINCT FROM (NEW.state, NEW.run_at, NEW.priority, NEW.queue, NEW.concurrency_key, NEW.attempted_at, NEW.revoked_at))
    EXECUTE FUNCTION leash.wake_concurrency_keys();

DROP TRIGGER IF EXISTS jobs_key_deleted ON leash.jobs;
CREATE TRIGGER jobs_key_deleted AFTER DELETE ON leash.jobs
    FOR EACH ROW WHEN (OLD.concurrency_key IS NOT NULL AND OLD.state IN ('available', 'retryable', 'running'))
    EXECUTE FUNCTION leash.wake_concurrency_keys();

-- Jobs without a key in a queue with a per-key limit are claimed by a walk of the queue's claim
-- index that passes over its jobs with a key, which the claim makes only when it has reason to
-- expect some: an entry of key '' (no job has that key) in leash.key_wakes, appended once per
-- transaction and queue when such a job is inserted or queued again (a retry, a hand-back, a
-- rescue). The triggers' WHEN reads leash.keyed_queues, the number of queues with a per-key
-- limit (no query): while there is none, which is always so on a fleet without them, the function
-- is not called. Every role that writes leash.jobs reads the sequence, as leash.room_waiting_until.
CREATE SEQUENCE IF NOT EXISTS leash.keyed_queues AS bigint MINVALUE 0 START 0;
GRANT SELECT ON SEQUENCE leash.keyed_queues TO PUBLIC;

CREATE OR REPLACE FUNCTION leash.wake_unkeyed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Once per transaction and queue (in a run of rows of one queue, as a COPY's): the entry
    -- commits with the whole transaction. A session that sets this itself only delays its own
    -- jobs, to the claims' periodic look.
    IF current_setting('leash.unkeyed_woken', true) IS DISTINCT FROM NEW.queue THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT NEW.queue, ''
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = NEW.queue AND q.max_running_per_key IS NOT NULL);
        PERFORM set_config('leash.unkeyed_woken', NEW.queue, true);
    END IF;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.wake_unkeyed() FROM PUBLIC;

DROP TRIGGER IF EXISTS jobs_unkeyed_inserted ON leash.jobs;
CREATE TRIGGER jobs_unkeyed_inserted AFTER INSERT ON leash.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NULL
        AND pg_catalog.pg_sequence_last_value('leash.keyed_queues'::regclass) OPERATOR(pg_catalog.>) 0)
    EXECUTE FUNCTION leash.wake_unkeyed();

DROP TRIGGER IF EXISTS jobs_unkeyed_requeued ON leash.jobs;
CREATE TRIGGER jobs_unkeyed_requeued AFTER UPDATE ON leash.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NULL AND NEW.state IN ('available', 'retryable')
        AND OLD.state IS DISTINCT FROM NEW.state
        AND pg_catalog.pg_sequence_last_value('leash.keyed_queues'::regclass) OPERATOR(pg_catalog.>) 0)
    EXECUTE FUNCTION leash.wake_unkeyed();

-- A per-key limit set or changed wakes every key of the queue that has unfinished jobs (their
-- rows are built by the next claim); a limit removed drops the queue's rows and wakes, which
-- nothing reads then (the queue is claimed as any other).
CREATE OR REPLACE FUNCTION leash.queue_keys_limit_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.max_running_per_key IS NOT DISTINCT FROM NEW.max_running_per_key THEN
        RETURN NULL;
    END IF;
    PERFORM setval('leash.keyed_queues', (SELECT count(*) FROM leash.queues q WHERE q.max_running_per_key IS NOT NULL), true);
    IF NEW.max_running_per_key IS NULL THEN
        DELETE FROM leash.concurrency_keys c WHERE c.queue = NEW.name;
        DELETE FROM leash.key_wakes w WHERE w.queue = NEW.name;
        RETURN NULL;
    END IF;
    INSERT INTO leash.key_wakes (queue, key)
    SELECT DISTINCT NEW.name, j.concurrency_key FROM leash.jobs j
    WHERE j.queue = NEW.name AND j.concurrency_key IS NOT NULL AND j.state IN ('available', 'retryable', 'running')
    UNION ALL
    SELECT NEW.name, '';
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.queue_keys_limit_changed() FROM PUBLIC;

DROP TRIGGER IF EXISTS queues_keys_limit_changed ON leash.queues;
CREATE TRIGGER queues_keys_limit_changed AFTER INSERT OR UPDATE OF max_running_per_key ON leash.queues
    FOR EACH ROW EXECUTE FUNCTION leash.queue_keys_limit_changed();

-- Sets the queue's per-key limit (NULL removes it): at most n jobs of one key of the queue hold
-- the key at once, across all workers, from its commit (it waits for the claims of the queue in
-- flight). Jobs already holding a key over a lowered limit go on. True when the limit changed.
CREATE OR REPLACE FUNCTION leash.set_queue_max_running_per_key(name text, n integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed boolean;
BEGIN
    INSERT INTO leash.queues AS q (name, max_running_per_key) VALUES (set_queue_max_running_per_key.name, n)
    ON CONFLICT ON CONSTRAINT queues_pkey DO UPDATE SET max_running_per_key = excluded.max_running_per_key, updated_at = now()
        WHERE q.max_running_per_key IS DISTINCT FROM excluded.max_running_per_key
    RETURNING true INTO changed;
    RETURN coalesce(changed, false);
END;
$$;

REVOKE ALL ON FUNCTION leash.set_queue_max_running_per_key(text, integer) FROM PUBLIC;

-- As in 010, with the per-key limit and the rate limit among what a worker's row may hold: a row
-- that holds one is an operator's setting and is never replaced.
CREATE OR REPLACE FUNCTION leash.queue_replaces_implicit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT NEW.implicit AND EXISTS (
        SELECT FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL AND q.max_running_per_key IS NULL
          AND q.rate_limit IS NULL) THEN
        DELETE FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL AND q.max_running_per_key IS NULL
          AND q.rate_limit IS NULL;
    END IF;
    RETURN NEW;
END;
$$;

-- The claim of a queue with a per-key limit, as functions whose few statements are planned once
-- per session (plan_cache_mode): planning one statement covering every step for its values took
-- longer than running it (about 6 ms on 100,000 keys), and PostgreSQL kept planning it anew. A
-- generic plan must not go wrong whatever the statistics (a fresh install, a table autovacuum has
-- not reached): the functions plan with nested loops over index scans only, so each statement
-- reaches a key's jobs through the key's own indexes and the keys through their tables' indexes,
-- in order, bound by a LIMIT (sequential, bitmap, hash and merge paths off). They run in the
-- claim's READ COMMITTED transaction after it took the queue's row (leash.capped_claim holds the
-- claim's mark): no other claim of the queue is in flight, and each statement's snapshot, taken
-- after the row was granted, sees every claim of the queue committed before. They run with the
-- caller's rights (the grants of docs/sql.md).

-- Brings the rows of keys ks of queue q in leash.concurrency_keys up to date, n being the queue's
-- limit, in one statement and so in one snapshot: a key with something to claim gets its row at
-- the position of that, any other loses its row. What to claim is, first, a job that holds the key
-- and waits to run again, and, while fewer than n hold the key, its first job not yet started;
-- due ones first, else the earliest to come due. Keys take turns: a due key whose jobs hold it is
-- placed no earlier than the latest start of those jobs, behind every key waiting since before
-- that (a key's position orders the keys a claim walks, never the jobs within a key).
CREATE OR REPLACE FUNCTION leash.refresh_concurrency_keys(q text, ks text[], n integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
BEGIN
    WITH calc AS (
        SELECT t.key, hc.holders, hc.started, best.priority, best.run_at, best.id
        FROM (SELECT DISTINCT x.key FROM unnest(ks) AS x(key) WHERE x.key IS NOT NULL AND x.key <> '') t
        CROSS JOIN LATERAL (
            SELECT count(*) AS holders, max(h.attempted_at) AS started FROM leash.jobs h
            WHERE h.queue = q AND h.concurrency_key = t.key AND h.concurrency_key IS NOT NULL
              AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))) hc
        LEFT JOIN LATERAL (
            SELECT s.priority, s.run_at, s.id FROM leash.jobs s
            WHERE s.queue = q AND s.concurrency_key = t.key AND s.concurrency_key IS NOT NULL
              AND (s.state = 'running' OR (s.state IN ('available', 'retryable') AND s.attempted_at IS NOT NULL))
              AND s.state IN ('available', 'retryable') AND s.attempted_at IS NOT NULL AND s.revoked_at IS NULL
            ORDER BY s.run_at > now(), CASE WHEN s.run_at > now() THEN s.run_at END, s.priority, s.run_at, s.id
            LIMIT 1) st ON true
        LEFT JOIN LATERAL (
            SELECT f.priority, f.run_at, f.id FROM leash.jobs f
            WHERE f.queue = q AND f.concurrency_key = t.key AND f.concurrency_key IS NOT NULL
              AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL AND f.revoked_at IS NULL
              AND f.run_at <= now() AND hc.holders < n
            ORDER BY f.priority, f.run_at, f.id
            LIMIT 1) fd ON true
        LEFT JOIN LATERAL (
            SELECT f.priority, f.run_at, f.id FROM leash.jobs f
            WHERE f.queue = q AND f.concurrency_key = t.key AND f.concurrency_key IS NOT NULL
              AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL AND f.revoked_at IS NULL
              AND f.run_at > now() AND hc.holders < n AND fd.id IS NULL AND (st.id IS NULL OR st.run_at > now())
            ORDER BY f.run_at, f.priority, f.id
            LIMIT 1) fl ON true
        LEFT JOIN LATERAL (
            SELECT c.priority, c.run_at, c.id
            FROM (VALUES (st.priority, st.run_at, st.id), (fd.priority, fd.run_at, fd.id), (fl.priority, fl.run_at, fl.id))
                 AS c(priority, run_at, id)
            WHERE c.id IS NOT NULL
            ORDER BY c.run_at > now(), CASE WHEN c.run_at > now() THEN c.run_at END, c.priority, c.run_at, c.id
            LIMIT 1) best ON true
    ), kept AS (
        INSERT INTO leash.concurrency_keys AS c (queue, key, next_priority, next_run_at, next_id)
        SELECT q, calc.key, calc.priority,
               CASE WHEN calc.run_at <= now() AND calc.started > calc.run_at THEN calc.started ELSE calc.run_at END,
               calc.id
        FROM calc WHERE calc.id IS NOT NULL
        ON CONFLICT (queue, key) DO UPDATE
            SET next_priority = excluded.next_priority, next_run_at = excluded.next_run_at, next_id = excluded.next_id
            WHERE (c.next_priority, c.next_run_at, c.next_id) IS DISTINCT FROM (excluded.next_priority, excluded.next_run_at, excluded.next_id)
    )
    DELETE FROM leash.concurrency_keys c
    WHERE c.queue = q AND c.key = ANY (ARRAY(SELECT calc.key FROM calc WHERE calc.id IS NULL));
END;
$$;

-- Brings the keys of queue q woken since the last claim up to date (at most 1,000, the rest wait
-- for the next), in a transaction of its own that holds the queue's row (mark) just before the
-- claim's: their entries are deleted first, and the keys' jobs read after that, so that every
-- change an entry stood for is seen; an entry of a transaction not yet committed stays for the
-- next claim. Its own transaction, so that the claim's (whose now() is its jobs' attempted_at)
-- counts each key's holders right after it starts.
CREATE OR REPLACE FUNCTION leash.claim_keyed_wakes(q text, mark text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    woken text[];
BEGIN
    SELECT qq.max_running_per_key INTO per_key
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF per_key IS NULL THEN
        RETURN;
    END IF;
    -- The woken keys, distinct, one descent of the index each (a key woken by every job of a
    -- 50,000-row COPY costs one, not 50,000 entries read), passing over the entries of wakes
    -- already deleted at the cost of an index entry each.
    woken := ARRAY(
        WITH RECURSIVE t(key, n) AS (
            SELECT (SELECT min(e.key) FROM leash.key_wakes e WHERE e.queue = q AND e.key > ''), 1
            UNION ALL
            SELECT (SELECT min(e.key) FROM leash.key_wakes e WHERE e.queue = q AND e.key > t.key), t.n + 1
            FROM t WHERE t.key IS NOT NULL AND t.n < 1000)
        SELECT t.key FROM t WHERE t.key IS NOT NULL);
    IF cardinality(woken) > 0 THEN
        DELETE FROM leash.key_wakes w WHERE w.queue = q AND w.key = ANY (woken);
        PERFORM leash.refresh_concurrency_keys(q, woken, per_key);
    END IF;
END;
$$;

-- Chooses what the claim of queue q (mark: the claim's, see above) leases, at most want jobs,
-- and returns their ctids; the claim locks and leases them (FOR UPDATE SKIP LOCKED). The walk
-- (after leash.claim_keyed_wakes): the keys with something due, in the order of their rows, at most as many
-- as the claim has room for; of each, the jobs that hold it and are due (they hold the key
-- already, and are few), then, while fewer than the limit hold it, its first jobs not yet
-- started. With unkeyed, or when jobs without a key were inserted or queued again since the last
-- claim (an entry of key ''), the queue's jobs without a key too. Of all these, by priority first,
-- the first job of each key comes before the second of any, keys in the order of their rows
-- (keys take turns; jobs without a key by their run_at). Nothing while the queue is paused, and
-- no more than its max_running leaves room for. The walked keys and the chosen jobs are kept in
-- settings of the transaction (leash.keyed_*) for leash.claim_keyed_done, which brings the keys up
-- to date after the lease.
CREATE OR REPLACE FUNCTION leash.claim_keyed_pick(q text, want integer, mark text, unkeyed boolean) RETURNS tid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    cap integer;
    paused timestamptz;
    rated boolean;
    room integer;
    walked text[];
    held integer[];
    waiting integer[];
    picked tid[];
    picked_ids bigint[];
    picked_turns integer[];
    picked_holds boolean[];
    spent text[];
    redo text[];
BEGIN
    SELECT qq.max_running_per_key, qq.max_running, qq.paused_at, qq.rate_limit IS NOT NULL INTO per_key, cap, paused, rated
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    PERFORM set_config('leash.keyed_walked', '{}', true), set_config('leash.keyed_spent', '{}', true),
            set_config('leash.keyed_redo', '{}', true), set_config('leash.keyed_picked', '{}', true);
    IF per_key IS NULL THEN
        RETURN '{}';
    END IF;
    -- Jobs without a key were inserted or queued again since the last claim that looked.
    DELETE FROM leash.key_wakes w WHERE w.queue = q AND w.key = '';
    IF FOUND THEN
        unkeyed := true;
    END IF;
    IF paused IS NOT NULL THEN
        RETURN '{}';
    END IF;
    room := want;
    IF cap IS NOT NULL THEN
        room := greatest(0, least(want, cap - (SELECT count(*) FROM leash.jobs rj WHERE rj.queue = q AND rj.state = 'running')::integer));
    END IF;
    IF rated THEN
        room := leash.rate_room(q, mark, room);
    END IF;
    IF room <= 0 THEN
        RETURN '{}';
    END IF;
    walked := ARRAY(
        SELECT c.key FROM leash.concurrency_keys c
        WHERE c.queue = q AND c.next_run_at <= now()
        ORDER BY c.next_priority, c.next_run_at, c.next_id, c.key
        LIMIT room);
    -- Each walked key's holders, and how many of them wait to run again.
    SELECT coalesce(array_agg(hc.holders ORDER BY w.o), '{}'), coalesce(array_agg(hc.waiting ORDER BY w.o), '{}')
    INTO held, waiting
    FROM unnest(walked) WITH ORDINALITY AS w(key, o)
    CROSS JOIN LATERAL (
        SELECT count(*)::integer AS holders, (count(*) FILTER (WHERE h.state <> 'running'))::integer AS waiting
        FROM leash.jobs h
        WHERE h.queue = q AND h.concurrency_key = w.key AND h.concurrency_key IS NOT NULL
          AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))) hc;
    SELECT coalesce(array_agg(ch.ctid ORDER BY ch.n), '{}'), coalesce(array_agg(ch.id ORDER BY ch.n), '{}'),
           coalesce(array_agg(ch.turn ORDER BY ch.n), '{}'), coalesce(array_agg(ch.holds ORDER BY ch.n), '{}')
    INTO picked, picked_ids, picked_turns, picked_holds
    FROM (
        SELECT cand.ctid, cand.id, cand.turn, cand.holds,
               row_number() OVER (ORDER BY cand.priority, cand.rank, cand.turn, cand.run_at, cand.id) AS n
        FROM (
            SELECT s.ctid, s.priority, s.rank, w.o::integer AS turn, s.run_at, s.id, s.holds
            FROM unnest(walked, held) WITH ORDINALITY AS w(key, holders, o)
            CROSS JOIN LATERAL (
                SELECT g.ctid, g.priority, g.run_at, g.id, g.holds,
                       row_number() OVER (ORDER BY g.priority, g.run_at, g.id) AS rank
                FROM (
                    (SELECT a.ctid, a.priority, a.run_at, a.id, true AS holds FROM leash.jobs a
                     WHERE a.queue = q AND a.concurrency_key = w.key AND a.concurrency_key IS NOT NULL
                       AND (a.state = 'running' OR (a.state IN ('available', 'retryable') AND a.attempted_at IS NOT NULL))
                       AND a.state IN ('available', 'retryable') AND a.attempted_at IS NOT NULL
                       AND a.run_at <= now() AND a.revoked_at IS NULL
                     ORDER BY a.priority, a.run_at, a.id
                     LIMIT room)
                    UNION ALL
                    (SELECT f.ctid, f.priority, f.run_at, f.id, false FROM leash.jobs f
                     WHERE f.queue = q AND f.concurrency_key = w.key AND f.concurrency_key IS NOT NULL
                       AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL
                       AND f.run_at <= now() AND f.revoked_at IS NULL
                     ORDER BY f.priority, f.run_at, f.id
                     LIMIT least(room, greatest(per_key - w.holders, 0)))) g) s
            UNION ALL
            SELECT uk.ctid, uk.priority, row_number() OVER (ORDER BY uk.priority, uk.run_at, uk.id), 0, uk.run_at, uk.id, false
            FROM (SELECT u.ctid, u.priority, u.run_at, u.id FROM leash.jobs u
                  WHERE unkeyed AND u.queue = q AND u.state IN ('available', 'retryable') AND u.concurrency_key IS NULL
                    AND u.run_at <= now() AND u.revoked_at IS NULL
                  ORDER BY u.priority, u.run_at, u.id
                  LIMIT room) uk) cand
        ORDER BY cand.priority, cand.rank, cand.turn, cand.run_at, cand.id
        LIMIT room) ch;
    -- Once every chosen job is leased (leash.claim_keyed_done checks), a walked key whose holders
    -- then reach the limit, none of them waiting to run again, has nothing to claim: its row goes
    -- without reading its jobs again. Any other walked key is brought up to date in full.
    SELECT coalesce(array_agg(x.key) FILTER (WHERE x.spent), '{}'), coalesce(array_agg(x.key) FILTER (WHERE NOT x.spent), '{}')
    INTO spent, redo
    FROM (
        SELECT w.key, w.waiting - coalesce(t.resumed, 0) = 0 AND w.holders + coalesce(t.taken, 0) >= per_key AS spent
        FROM unnest(walked, held, waiting) WITH ORDINALITY AS w(key, holders, waiting, o)
        LEFT JOIN (
            SELECT c.turn, count(*) FILTER (WHERE NOT c.holds) AS taken, count(*) FILTER (WHERE c.holds) AS resumed
            FROM unnest(picked_turns, picked_holds) AS c(turn, holds) GROUP BY c.turn) t ON t.turn = w.o) x;
    PERFORM set_config('leash.keyed_walked', walked::text, true),
            set_config('leash.keyed_spent', spent::text, true),
            set_config('leash.keyed_redo', redo::text, true),
            set_config('leash.keyed_picked', picked_ids::text, true);
    RETURN picked;
END;
$$;

-- After the claim's lease, in the same transaction: brings the keys leash.claim_keyed_pick walked
-- up to date. When every job it chose was leased, the keys it found spent (at their limit, no
-- holder waiting to run again) lose their rows without a look at their jobs; otherwise, and for
-- the other keys, their jobs are read again.
CREATE OR REPLACE FUNCTION leash.claim_keyed_done(q text, mark text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    rated boolean;
    ids bigint[];
    spent text[];
BEGIN
    SELECT qq.max_running_per_key, qq.rate_limit IS NOT NULL INTO per_key, rated
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF per_key IS NULL THEN
        RETURN;
    END IF;
    ids := coalesce(nullif(current_setting('leash.keyed_picked', true), ''), '{}')::bigint[];
    spent := coalesce(nullif(current_setting('leash.keyed_spent', true), ''), '{}')::text[];
    IF rated THEN
        -- The starts this claim made count against the queue's rate limit.
        PERFORM leash.rate_take(q, mark, (SELECT count(*) FROM leash.jobs j
                                          WHERE j.id = ANY (ids) AND j.state = 'running' AND j.attempted_at = now())::integer);
    END IF;
    IF cardinality(spent) > 0 AND (SELECT count(*) FROM leash.jobs j
                                  WHERE j.id = ANY (ids) AND j.state = 'running' AND j.attempted_at = now()) = cardinality(ids) THEN
        DELETE FROM leash.concurrency_keys c WHERE c.queue = q AND c.key = ANY (spent);
        PERFORM leash.refresh_concurrency_keys(q, coalesce(nullif(current_setting('leash.keyed_redo', true), ''), '{}')::text[], per_key);
    ELSE
        PERFORM leash.refresh_concurrency_keys(q, coalesce(nullif(current_setting('leash.keyed_walked', true), ''), '{}')::text[], per_key);
    END IF;
END;
$$;


-- Rate limits. A queue with rate_limit R is claimed under its row, as a capped queue is (one
-- claim of the queue at a time across all workers), and every start is written into a ring of R
-- slots (leash.rate_slots), each holding the time of the last start made in it (the claim's
-- now(), its jobs' attempted_at). A claim at time T may start a job in a slot only if that slot's
-- last start is at least one period before T; it takes slots in ring order from the head
-- (leash.rate_heads) while they are free, and moves the head past those it used. Each slot's
-- starts are thus at least a period apart, so any window of one period (a half-open interval)
-- holds at most one start per slot: at most R, exactly, across all workers, whatever order the
-- claims' clocks commit in. A claim reads and writes only the slots it uses (by primary key;
-- started_at is in no index, so writes are heap-only), under its own queue's row: no other
-- queue's claim ever reads them. A change of R rebuilds the ring in the changing transaction,
-- keeping the latest starts (the windows after the change hold at most the new R); a change of
-- the period applies to the starts already made.
CREATE TABLE IF NOT EXISTS leash.rate_slots (
    queue      text        NOT NULL,
    slot       integer     NOT NULL,
    started_at timestamptz NOT NULL,
    PRIMARY KEY (queue, slot)
) WITH (fillfactor = 50);

CREATE TABLE IF NOT EXISTS leash.rate_heads (
    queue text   NOT NULL PRIMARY KEY,
    head  bigint NOT NULL
) WITH (fillfactor = 50);

REVOKE ALL ON leash.rate_slots, leash.rate_heads FROM PUBLIC;

-- Rebuilds the ring of a queue whose rate_limit was set or changed (dropped when removed): the
-- starts it holds, oldest first from the head, keep the latest rate_limit of them, and free slots
-- (-infinity) make up the rest, first. Runs in the transaction that changes the row, which holds
-- it, so no claim of the queue runs meanwhile. A ring left by a deleted row is taken up again.
CREATE OR REPLACE FUNCTION leash.queue_rate_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    h     bigint;
    n     integer;
    lim   integer := NEW.rate_limit;
    starts timestamptz[];
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.rate_limit IS NOT DISTINCT FROM NEW.rate_limit THEN
        RETURN NULL;
    END IF;
    IF lim IS NULL THEN
        DELETE FROM leash.rate_slots s WHERE s.queue = NEW.name;
        DELETE FROM leash.rate_heads r WHERE r.queue = NEW.name;
        RETURN NULL;
    END IF;
    SELECT r.head INTO h FROM leash.rate_heads r WHERE r.queue = NEW.name FOR UPDATE;
    SELECT count(*) INTO n FROM leash.rate_slots s WHERE s.queue = NEW.name;
    starts := ARRAY(SELECT s.started_at FROM leash.rate_slots s WHERE s.queue = NEW.name
                    ORDER BY (s.slot - coalesce(h, 0) % greatest(n, 1) + n) % greatest(n, 1), s.slot);
    starts := array_fill('-infinity'::timestamptz, ARRAY[greatest(lim - n, 0)])
              || coalesce(starts[greatest(n - lim, 0) + 1 : n], '{}');
    DELETE FROM leash.rate_slots s WHERE s.queue = NEW.name;
    INSERT INTO leash.rate_slots (queue, slot, started_at)
    SELECT NEW.name, (u.o - 1)::integer, u.at FROM unnest(starts) WITH ORDINALITY AS u(at, o);
    INSERT INTO leash.rate_heads AS r (queue, head) VALUES (NEW.name, 0)
    ON CONFLICT (queue) DO UPDATE SET head = 0;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.queue_rate_changed() FROM PUBLIC;

DROP TRIGGER IF EXISTS queues_rate_changed ON leash.queues;
CREATE TRIGGER queues_rate_changed AFTER INSERT OR UPDATE OF rate_limit ON leash.queues
    FOR EACH ROW EXECUTE FUNCTION leash.queue_rate_changed();

-- How many of want jobs the claim of queue q (mark: the claim's, see leash.claim_keyed_pick) may
-- start now under the queue's rate limit: want when it has none; 0 without the queue's row. The
-- free slots counted are those from the head on, in ring order, up to the first still in use.
-- The head is locked for the claim (SKIP LOCKED: a transaction holding it stops only this
-- queue, which starts nothing meanwhile). With the caller's rights (the grants of docs/sql.md).
CREATE OR REPLACE FUNCTION leash.rate_room(q text, mark text, want integer) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lim integer;
    per interval;
    h   bigint;
    n   integer;
BEGIN
    SELECT qq.rate_limit, coalesce(qq.rate_period, interval '1 second') INTO lim, per
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF lim IS NULL THEN
        RETURN greatest(want, 0);
    END IF;
    want := least(want, lim);
    IF want <= 0 THEN
        RETURN 0;
    END IF;
    SELECT r.head INTO h FROM leash.rate_heads r WHERE r.queue = q FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT coalesce(min(i.i), want) INTO n
    FROM generate_series(0, want - 1) AS i(i)
    JOIN leash.rate_slots s ON s.queue = q AND s.slot = ((h + i.i) % lim)::integer
    WHERE s.started_at + per > now();
    RETURN n;
END;
$$;

-- Records n starts of the claim of queue q (mark: the claim's), made at now(), in the next n
-- slots from the head, and moves the head past them; n is at most what leash.rate_room allowed
-- in the same transaction. Returns how long (milliseconds) until the slot at the new head is
-- free, 0 when it is free now; NULL when the queue has no rate limit or the row is not held.
-- Its writes wait at most 100ms for a row lock (a transaction holding a slot fails this claim
-- of this queue, and its jobs stay queued).
CREATE OR REPLACE FUNCTION leash.rate_take(q text, mark text, n integer) RETURNS double precision
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '100ms' AS $$
DECLARE
    lim integer;
    per interval;
    h   bigint;
    nxt timestamptz;
BEGIN
    SELECT qq.rate_limit, coalesce(qq.rate_period, interval '1 second') INTO lim, per
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF NOT FOUND OR lim IS NULL THEN
        RETURN NULL;
    END IF;
    IF lim = 0 THEN
        RETURN extract(epoch FROM per) * 1000;
    END IF;
    SELECT r.head INTO h FROM leash.rate_heads r WHERE r.queue = q;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    n := least(greatest(coalesce(n, 0), 0), lim);
    IF n > 0 THEN
        INSERT INTO leash.rate_slots AS s (queue, slot, started_at)
        SELECT q, ((h + i.i) % lim)::integer, now() FROM generate_series(0, n - 1) AS i(i)
        ON CONFLICT (queue, slot) DO UPDATE SET started_at = excluded.started_at;
        UPDATE leash.rate_heads r SET head = r.head + n WHERE r.queue = q;
        h := h + n;
    END IF;
    SELECT s.started_at + per INTO nxt FROM leash.rate_slots s WHERE s.queue = q AND s.slot = (h % lim)::integer;
    IF nxt IS NULL OR nxt <= now() THEN
        RETURN 0; -- free (a slot never used holds -infinity)
    END IF;
    RETURN extract(epoch FROM nxt - now()) * 1000;
END;
$$;

-- Sets the queue's rate limit: at most n starts in any window of period (NULL: one second)
-- across all workers, from its commit (it waits for the claims of the queue in flight); NULL n
-- removes it. True when it changed.
CREATE OR REPLACE FUNCTION leash.set_queue_rate_limit(name text, n integer, period interval DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed boolean;
BEGIN
    IF n IS NULL THEN
        period := NULL;
    END IF;
    INSERT INTO leash.queues AS q (name, rate_limit, rate_period) VALUES (set_queue_rate_limit.name, n, period)
    ON CONFLICT ON CONSTRAINT queues_pkey DO UPDATE
        SET rate_limit = excluded.rate_limit, rate_period = excluded.rate_period, updated_at = now()
        WHERE (q.rate_limit, q.rate_period) IS DISTINCT FROM (excluded.rate_limit, excluded.rate_period)
    RETURNING true INTO changed;
    RETURN coalesce(changed, false);
END;
$$;

REVOKE ALL ON FUNCTION leash.set_queue_rate_limit(text, integer, interval) FROM PUBLIC;
