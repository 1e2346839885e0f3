-- leash 029: per-key rate limits, claims that wake up when a key's next job comes due, and keys
-- whose holder's outcome was in flight as their queue's first limit was set.
--
-- A queue may set key_rate_limit and key_rate_period: at most key_rate_limit starts of the jobs of
-- one key in any window of key_rate_period (NULL: one second) across all workers, for every key of
-- the queue. A queue with a per-key rate limit is claimed as one with a per-key limit is (025),
-- under its row, one claim at a time across all workers; with no max_running_per_key, any number
-- of a key's jobs may run at once. Every claim of such a queue writes the starts it made of each
-- key into the key's row of leash.key_rates (the latest key_rate_limit start times, newest
-- first). A claim at time T starts a job of a key only while fewer than key_rate_limit of those
-- are later than T - key_rate_period: a start admitted at T sees every start made before it of
-- its window, whatever order the claims' clocks commit in, so no window of one period (a
-- half-open interval) ever holds more than key_rate_limit starts of one key. A key with no room
-- keeps its row in leash.concurrency_keys at the time its oldest counted start leaves the window,
-- so the claims pass over it, and walk no key that could not start.
--
-- Safe to apply while workers of the previous release run: it adds two columns (NULL, no
-- rewrite), a check that reads the few rows of leash.queues, a table, an index on
-- leash.concurrency_keys and functions; it replaces 025's functions with versions that do what
-- they did for a queue without a per-key rate limit (as every queue those workers create is).
-- Those workers ignore per-key rate limits: a queue whose per-key rate limit must hold needs
-- every worker of this release.

ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS key_rate_limit integer;
ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS key_rate_period interval;

-- At most 1,000 starts per key and period: a key's row holds them all. A period is checked by
-- the time it spans (extract(epoch), as the claims use it: leash.rate_window), not by interval
-- comparison, which counts a year as 360 days and a month as 30: '-1 year 361 days' compares as
-- one day but moves a timestamp back by four. The same check for the queue's own rate_period
-- (migration 025), for new and changed rows: an old row is read through leash.rate_window too.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'queues_key_rate_limit_check'
                   AND conrelid = 'leash.queues'::regclass) THEN
        ALTER TABLE leash.queues ADD CONSTRAINT queues_key_rate_limit_check
            CHECK ((key_rate_limit IS NULL OR key_rate_limit BETWEEN 0 AND 1000)
                   AND (key_rate_period IS NULL OR extract(epoch FROM key_rate_period) BETWEEN 0.001 AND 2678400));
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'queues_rate_period_span_check'
                   AND conrelid = 'leash.queues'::regclass) THEN
        ALTER TABLE leash.queues ADD CONSTRAINT queues_rate_period_span_check
            CHECK (rate_period IS NULL OR extract(epoch FROM rate_period) BETWEEN 0.001 AND 2678400) NOT VALID;
    END IF;
END;
$$;

-- The window of a rate limit's period p (NULL: one second) as the time it spans, in seconds
-- alone (no days, months or years, which a timestamp's arithmetic takes by the calendar and the
-- session's time zone), within 1 ms and 31 days whatever an old row holds.
CREATE OR REPLACE FUNCTION leash.rate_window(p interval) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
    SELECT make_interval(secs => least(greatest(extract(epoch FROM coalesce(p, interval '1 second')), 0.001), 2678400)::double precision)
$$;

-- What leash.key_rates.starts may hold: at most 1,000 start times, none NULL, newest first, in a
-- one-dimensional array from index 1 (the claims read starts[k] as the k-th newest).
CREATE OR REPLACE FUNCTION leash.key_starts_valid(s timestamptz[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s IS NOT NULL AND (cardinality(s) = 0 OR (
        array_ndims(s) = 1 AND array_lower(s, 1) = 1 AND cardinality(s) <= 1000
        AND array_position(s, NULL) IS NULL
        AND NOT EXISTS (SELECT FROM generate_series(1, cardinality(s) - 1) i WHERE s[i] < s[i + 1])))
$$;

-- The starts of a key of a queue with a per-key rate limit: the latest key_rate_limit of them,
-- newest first (starts[key_rate_limit] is when the key has room again, once a period later).
-- Written by claims only (each holding its queue's row), so its rows are never waited for; a row
-- whose starts have all left the window is deleted by retention (leash.delete_idle_key_rates).
CREATE TABLE IF NOT EXISTS leash.key_rates (
    queue  text          NOT NULL,
    key    text          NOT NULL,
    starts timestamptz[] NOT NULL CHECK (leash.key_starts_valid(starts)),
    PRIMARY KEY (queue, key)
);

REVOKE ALL ON leash.key_rates FROM PUBLIC;

-- The next key of a queue to come due, in one descent: a claim of the queue tells its worker when
-- to claim again (a key's first job scheduled for later, a key waiting for room under its rate).
CREATE INDEX IF NOT EXISTS concurrency_keys_due_idx ON leash.concurrency_keys (queue, next_run_at);

-- A queue whose per-key limits were set or changed, until its claims have looked at every key of
-- it once more after every transaction that could have missed the change ended. Such a
-- transaction (an insert of a job with a key, an outcome of one) ran its trigger before the
-- change committed, saw no limit and woke no key; the change's own look at the queue's keys did
-- not see that transaction's rows, uncommitted then. horizon: NULL until the first claim after
-- the change, which sets it to the first transaction id not yet begun in its snapshot (every
-- such transaction has a lower one); the first claim whose snapshot has no transaction below it
-- running wakes every key of the queue with unfinished jobs, and deletes the row. Written by
-- the change's trigger and by claims (holding the queue's row).
CREATE TABLE IF NOT EXISTS leash.key_sweeps (
    queue   text PRIMARY KEY,
    horizon xid8
);

REVOKE ALL ON leash.key_sweeps FROM PUBLIC;

-- A queue is claimed key by key (025) when it has a per-key limit or a per-key rate limit. The
-- triggers of 025 on leash.jobs append to leash.key_wakes for jobs with a key in such a queue. A
-- writer whose snapshot is its transaction's (REPEATABLE READ, SERIALIZABLE) may not see a limit
-- committed after that snapshot was taken, nor the sweep that followed (leash.key_sweeps waits
-- for transaction ids, which such a writer may take only after it): while any queue has a
-- per-key limit (leash.keyed_queues, a sequence, read outside any snapshot), it appends its keys
-- whatever its snapshot says; retention deletes those of queues not claimed key by key.
CREATE OR REPLACE FUNCTION leash.wake_concurrency_keys() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.concurrency_key IS NOT NULL THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT OLD.queue, OLD.concurrency_key
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = OLD.queue
                      AND (q.max_running_per_key IS NOT NULL OR q.key_rate_limit IS NOT NULL))
           OR (current_setting('transaction_isolation') <> 'read committed'
               AND pg_sequence_last_value('leash.keyed_queues'::regclass) > 0);
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.concurrency_key IS NOT NULL
       AND (TG_OP = 'INSERT' OR NEW.queue IS DISTINCT FROM OLD.queue OR NEW.concurrency_key IS DISTINCT FROM OLD.concurrency_key) THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT NEW.queue, NEW.concurrency_key
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = NEW.queue
                      AND (q.max_running_per_key IS NOT NULL OR q.key_rate_limit IS NOT NULL))
           OR (current_setting('transaction_isolation') <> 'read committed'
               AND pg_sequence_last_value('leash.keyed_queues'::regclass) > 0);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION leash.wake_unkeyed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('leash.unkeyed_woken', true) IS DISTINCT FROM NEW.queue THEN
        INSERT INTO leash.key_wakes (queue, key)
        SELECT NEW.queue, ''
        WHERE EXISTS (SELECT FROM leash.queues q WHERE q.name = NEW.queue
                      AND (q.max_running_per_key IS NOT NULL OR q.key_rate_limit IS NOT NULL))
           OR (current_setting('transaction_isolation') <> 'read committed'
               AND pg_sequence_last_value('leash.keyed_queues'::regclass) > 0);
        PERFORM set_config('leash.unkeyed_woken', NEW.queue, true);
    END IF;
    RETURN NULL;
END;
$$;

-- A per-key limit or per-key rate limit set or changed wakes every key of the queue that has
-- unfinished jobs, and again once every transaction in flight meanwhile has ended
-- (leash.key_sweeps); both removed, the queue's rows go (it is claimed as any other). A per-key
-- rate limit removed drops the queue's starts; a changed one keeps them (a window after the
-- change holds at most the new limit).
CREATE OR REPLACE FUNCTION leash.queue_keys_limit_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND (OLD.max_running_per_key, OLD.key_rate_limit, OLD.key_rate_period)
                            IS NOT DISTINCT FROM (NEW.max_running_per_key, NEW.key_rate_limit, NEW.key_rate_period) THEN
        RETURN NULL;
    END IF;
    PERFORM setval('leash.keyed_queues', (SELECT count(*) FROM leash.queues q
                                          WHERE q.max_running_per_key IS NOT NULL OR q.key_rate_limit IS NOT NULL), true);
    IF NEW.key_rate_limit IS NULL THEN
        DELETE FROM leash.key_rates r WHERE r.queue = NEW.name;
    END IF;
    IF NEW.max_running_per_key IS NULL AND NEW.key_rate_limit IS NULL THEN
        DELETE FROM leash.concurrency_keys c WHERE c.queue = NEW.name;
        DELETE FROM leash.key_wakes w WHERE w.queue = NEW.name;
        DELETE FROM leash.key_sweeps s WHERE s.queue = NEW.name;
        RETURN NULL;
    END IF;
    INSERT INTO leash.key_sweeps AS s (queue, horizon) VALUES (NEW.name, NULL)
    ON CONFLICT (queue) DO UPDATE SET horizon = NULL;
    INSERT INTO leash.key_wakes (queue, key)
    SELECT DISTINCT NEW.name, j.concurrency_key FROM leash.jobs j
    WHERE j.queue = NEW.name AND j.concurrency_key IS NOT NULL AND j.state IN ('available', 'retryable', 'running')
    UNION ALL
    SELECT NEW.name, '';
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS queues_keys_limit_changed ON leash.queues;
CREATE TRIGGER queues_keys_limit_changed
    AFTER INSERT OR UPDATE OF max_running_per_key, key_rate_limit, key_rate_period ON leash.queues
    FOR EACH ROW EXECUTE FUNCTION leash.queue_keys_limit_changed();

-- Sets the queue's per-key rate limit: at most n starts of the jobs of one key in any window of
-- period (NULL: one second) across all workers, from its commit (it waits for the claims of the
-- queue in flight); NULL n removes it. True when it changed.
CREATE OR REPLACE FUNCTION leash.set_queue_key_rate_limit(name text, n integer, period interval DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed boolean;
BEGIN
    IF n IS NULL THEN
        period := NULL;
    END IF;
    INSERT INTO leash.queues AS q (name, key_rate_limit, key_rate_period) VALUES (set_queue_key_rate_limit.name, n, period)
    ON CONFLICT ON CONSTRAINT queues_pkey DO UPDATE
        SET key_rate_limit = excluded.key_rate_limit, key_rate_period = excluded.key_rate_period, updated_at = now()
        WHERE (q.key_rate_limit, q.key_rate_period) IS DISTINCT FROM (excluded.key_rate_limit, excluded.key_rate_period)
    RETURNING true INTO changed;
    RETURN coalesce(changed, false);
END;
$$;

REVOKE ALL ON FUNCTION leash.set_queue_key_rate_limit(text, integer, interval) FROM PUBLIC;

-- As in 025, with the per-key rate limit among an operator's settings.
CREATE OR REPLACE FUNCTION leash.queue_replaces_implicit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT NEW.implicit AND EXISTS (
        SELECT FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL AND q.max_running_per_key IS NULL
          AND q.rate_limit IS NULL AND q.key_rate_limit IS NULL) THEN
        DELETE FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL AND q.max_running_per_key IS NULL
          AND q.rate_limit IS NULL AND q.key_rate_limit IS NULL;
    END IF;
    RETURN NEW;
END;
$$;

-- The claim's functions of 025, for a queue with a per-key limit (n) or a per-key rate limit or
-- both (n is 2147483647 without a per-key limit). As in 025, they plan once per session, with
-- nested loops over index scans only, and run in the claim's transaction holding the queue's row.

-- As in 025: brings the rows of keys ks of queue q up to date. A key under a per-key rate limit
-- with no room is placed no earlier than the time its oldest counted start leaves the window
-- (never, with a limit of 0).
CREATE OR REPLACE FUNCTION leash.refresh_keys(q text, ks text[], n integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    klim integer;
    kper interval;
BEGIN
    SELECT qq.key_rate_limit, leash.rate_window(qq.key_rate_period) INTO klim, kper
    FROM leash.queues qq WHERE qq.name = q;
    WITH calc AS (
        SELECT t.key, hc.holders, hc.started, best.priority, best.run_at, best.id,
               CASE WHEN klim IS NULL THEN NULL
                    WHEN klim = 0 THEN 'infinity'::timestamptz
                    -- A start written by hand a year ahead holds the key until then, as never.
                    WHEN cardinality(kr.starts) >= klim AND kr.starts[klim] > now() + interval '1 year' THEN 'infinity'::timestamptz
                    WHEN cardinality(kr.starts) >= klim THEN kr.starts[klim] + kper
               END AS free_at
        FROM (SELECT DISTINCT x.key FROM unnest(ks) AS x(key) WHERE x.key IS NOT NULL AND x.key <> '') t
        CROSS JOIN LATERAL (
            SELECT count(*) AS holders, max(h.attempted_at) AS started FROM leash.jobs h
            WHERE h.queue = q AND h.concurrency_key = t.key AND h.concurrency_key IS NOT NULL
              AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))) hc
        LEFT JOIN LATERAL (
            SELECT r.starts FROM leash.key_rates r WHERE r.queue = q AND r.key = t.key AND klim IS NOT NULL) kr ON true
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
    ), placed AS (
        SELECT calc.key, calc.priority, calc.id,
               greatest(CASE WHEN calc.run_at <= now() AND calc.started > calc.run_at THEN calc.started ELSE calc.run_at END,
                        calc.free_at) AS at
        FROM calc WHERE calc.id IS NOT NULL
    ), kept AS (
        INSERT INTO leash.concurrency_keys AS c (queue, key, next_priority, next_run_at, next_id)
        SELECT q, placed.key, placed.priority, placed.at, placed.id FROM placed
        ON CONFLICT (queue, key) DO UPDATE
            SET next_priority = excluded.next_priority, next_run_at = excluded.next_run_at, next_id = excluded.next_id
            WHERE (c.next_priority, c.next_run_at, c.next_id) IS DISTINCT FROM (excluded.next_priority, excluded.next_run_at, excluded.next_id)
    )
    DELETE FROM leash.concurrency_keys c
    WHERE c.queue = q AND c.key = ANY (ARRAY(SELECT calc.key FROM calc WHERE calc.id IS NULL));
END;
$$;

-- 025's refresh, for a worker of a release between 025 and this one.
CREATE OR REPLACE FUNCTION leash.refresh_concurrency_keys(q text, ks text[], n integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM leash.refresh_keys(q, ks, n);
END;
$$;

-- As in 025, for a queue with a per-key limit or a per-key rate limit, and the queue's sweep once
-- due (leash.key_sweeps).
CREATE OR REPLACE FUNCTION leash.claim_keyed_wakes(q text, mark text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    woken text[];
    horizon xid8;
BEGIN
    SELECT coalesce(qq.max_running_per_key, CASE WHEN qq.key_rate_limit IS NOT NULL THEN 2147483647 END) INTO per_key
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF per_key IS NULL THEN
        RETURN;
    END IF;
    SELECT s.horizon INTO horizon FROM leash.key_sweeps s WHERE s.queue = q;
    IF FOUND THEN
        IF horizon IS NULL THEN
            UPDATE leash.key_sweeps s SET horizon = pg_snapshot_xmax(pg_current_snapshot()) WHERE s.queue = q;
        ELSIF pg_snapshot_xmin(pg_current_snapshot()) >= horizon THEN
            -- The keys with jobs not yet started, and those with holders, each through its index.
            INSERT INTO leash.key_wakes (queue, key)
            SELECT q, k.key FROM (
                SELECT f.concurrency_key AS key FROM leash.jobs f
                WHERE f.queue = q AND f.concurrency_key IS NOT NULL
                  AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL
                UNION
                SELECT h.concurrency_key FROM leash.jobs h
                WHERE h.queue = q AND h.concurrency_key IS NOT NULL
                  AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))) k
            UNION ALL
            SELECT q, '';
            DELETE FROM leash.key_sweeps s WHERE s.queue = q;
        END IF;
    END IF;
    woken := ARRAY(
        WITH RECURSIVE t(key, n) AS (
            SELECT (SELECT min(e.key) FROM leash.key_wakes e WHERE e.queue = q AND e.key > ''), 1
            UNION ALL
            SELECT (SELECT min(e.key) FROM leash.key_wakes e WHERE e.queue = q AND e.key > t.key), t.n + 1
            FROM t WHERE t.key IS NOT NULL AND t.n < 1000)
        SELECT t.key FROM t WHERE t.key IS NOT NULL);
    IF cardinality(woken) > 0 THEN
        DELETE FROM leash.key_wakes w WHERE w.queue = q AND w.key = ANY (woken);
        PERFORM leash.refresh_keys(q, woken, per_key);
    END IF;
END;
$$;

-- As in 025, and under a per-key rate limit, no more of a key's jobs than the key has room for
-- (its starts later than now() - its window, read from leash.key_rates); the wake of jobs without
-- a key is taken only by a claim with room.
CREATE OR REPLACE FUNCTION leash.claim_keyed_pick(q text, want integer, mark text, unkeyed boolean) RETURNS tid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    cap integer;
    paused timestamptz;
    rated boolean;
    klim integer;
    kper interval;
    room integer;
    walked text[];
    held integer[];
    waiting integer[];
    rooms integer[];
    picked tid[];
    picked_ids bigint[];
    picked_turns integer[];
    picked_holds boolean[];
    spent text[];
    redo text[];
BEGIN
    SELECT coalesce(qq.max_running_per_key, CASE WHEN qq.key_rate_limit IS NOT NULL THEN 2147483647 END), qq.max_running, qq.paused_at,
           qq.rate_limit IS NOT NULL, qq.key_rate_limit, leash.rate_window(qq.key_rate_period)
    INTO per_key, cap, paused, rated, klim, kper
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    PERFORM set_config('leash.keyed_walked', '{}', true), set_config('leash.keyed_spent', '{}', true),
            set_config('leash.keyed_redo', '{}', true), set_config('leash.keyed_picked', '{}', true);
    IF per_key IS NULL THEN
        RETURN '{}';
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
    -- Jobs without a key were inserted or queued again since the last claim that looked: taken
    -- only by a claim that looks (in 025, a paused queue's claim, or one without room, took the
    -- entry and looked at nothing, leaving those jobs to the periodic look).
    DELETE FROM leash.key_wakes w WHERE w.queue = q AND w.key = '';
    IF FOUND THEN
        unkeyed := true;
    END IF;
    walked := ARRAY(
        SELECT c.key FROM leash.concurrency_keys c
        WHERE c.queue = q AND c.next_run_at <= now()
        ORDER BY c.next_priority, c.next_run_at, c.next_id, c.key
        LIMIT room);
    -- Each walked key's holders, how many of them wait to run again, and how many of its jobs it
    -- may start under its rate.
    SELECT coalesce(array_agg(hc.holders ORDER BY w.o), '{}'), coalesce(array_agg(hc.waiting ORDER BY w.o), '{}'),
           coalesce(array_agg(kr.room ORDER BY w.o), '{}')
    INTO held, waiting, rooms
    FROM unnest(walked) WITH ORDINALITY AS w(key, o)
    CROSS JOIN LATERAL (
        SELECT count(*)::integer AS holders, (count(*) FILTER (WHERE h.state <> 'running'))::integer AS waiting
        FROM leash.jobs h
        WHERE h.queue = q AND h.concurrency_key = w.key AND h.concurrency_key IS NOT NULL
          AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))) hc
    -- The starts newest first: those in the window are the first m, and the key may start
    -- klim - m; of the last least(room, klim) positions up to klim, those in the window number
    -- m - (klim - least(room, klim)) when positive, so least(room, klim) minus them is what the
    -- claim may start of the key, read from at most room positions.
    CROSS JOIN LATERAL (
        SELECT CASE WHEN klim IS NULL THEN room
                    ELSE least(room, klim) - coalesce((
                        SELECT count(*)::integer FROM leash.key_rates r, generate_series(greatest(klim - room + 1, 1), klim) AS i(i)
                        WHERE r.queue = q AND r.key = w.key AND r.starts[i.i] > now() - kper), 0)
               END AS room) kr;
    SELECT coalesce(array_agg(ch.ctid ORDER BY ch.n), '{}'), coalesce(array_agg(ch.id ORDER BY ch.n), '{}'),
           coalesce(array_agg(ch.turn ORDER BY ch.n), '{}'), coalesce(array_agg(ch.holds ORDER BY ch.n), '{}')
    INTO picked, picked_ids, picked_turns, picked_holds
    FROM (
        SELECT cand.ctid, cand.id, cand.turn, cand.holds,
               row_number() OVER (ORDER BY cand.priority, cand.rank, cand.turn, cand.run_at, cand.id) AS n
        FROM (
            SELECT s.ctid, s.priority, s.rank, w.o::integer AS turn, s.run_at, s.id, s.holds
            FROM unnest(walked, held, rooms) WITH ORDINALITY AS w(key, holders, rr, o)
            CROSS JOIN LATERAL (
                SELECT r.ctid, r.priority, r.run_at, r.id, r.holds, r.rank
                FROM (
                    SELECT g.ctid, g.priority, g.run_at, g.id, g.holds,
                           row_number() OVER (ORDER BY g.priority, g.run_at, g.id) AS rank
                    FROM (
                        (SELECT a.ctid, a.priority, a.run_at, a.id, true AS holds FROM leash.jobs a
                         WHERE a.queue = q AND a.concurrency_key = w.key AND a.concurrency_key IS NOT NULL
                           AND (a.state = 'running' OR (a.state IN ('available', 'retryable') AND a.attempted_at IS NOT NULL))
                           AND a.state IN ('available', 'retryable') AND a.attempted_at IS NOT NULL
                           AND a.run_at <= now() AND a.revoked_at IS NULL
                         ORDER BY a.priority, a.run_at, a.id
                         LIMIT least(room, w.rr))
                        UNION ALL
                        (SELECT f.ctid, f.priority, f.run_at, f.id, false FROM leash.jobs f
                         WHERE f.queue = q AND f.concurrency_key = w.key AND f.concurrency_key IS NOT NULL
                           AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL
                           AND f.run_at <= now() AND f.revoked_at IS NULL
                         ORDER BY f.priority, f.run_at, f.id
                         LIMIT least(room, w.rr, greatest(per_key - w.holders, 0)))) g) r
                WHERE r.rank <= w.rr) s
            UNION ALL
            SELECT uk.ctid, uk.priority, row_number() OVER (ORDER BY uk.priority, uk.run_at, uk.id), 0, uk.run_at, uk.id, false
            FROM (SELECT u.ctid, u.priority, u.run_at, u.id FROM leash.jobs u
                  WHERE unkeyed AND u.queue = q AND u.state IN ('available', 'retryable') AND u.concurrency_key IS NULL
                    AND u.run_at <= now() AND u.revoked_at IS NULL
                  ORDER BY u.priority, u.run_at, u.id
                  LIMIT room) uk) cand
        ORDER BY cand.priority, cand.rank, cand.turn, cand.run_at, cand.id
        LIMIT room) ch;
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

-- After the claim's lease, in the same transaction: records the starts it made under the queue's
-- rate limit and of each key under the per-key rate limit, then brings the walked keys up to date
-- as 025's leash.claim_keyed_done did. Returns how many milliseconds until the claim of the queue
-- may find something it cannot now: the next key of the queue to come due (its first job
-- scheduled, or room again under its rate), or room again under the queue's rate limit; NULL when
-- there is no such time, or the queue's row is not held.
CREATE OR REPLACE FUNCTION leash.claim_keyed_finish(q text, mark text) RETURNS double precision
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
DECLARE
    per_key integer;
    rated boolean;
    klim integer;
    ids bigint[];
    spent text[];
    ks text[];
    started integer;
    rate_wait double precision;
    due timestamptz;
BEGIN
    SELECT coalesce(qq.max_running_per_key, CASE WHEN qq.key_rate_limit IS NOT NULL THEN 2147483647 END), qq.rate_limit IS NOT NULL, qq.key_rate_limit
    INTO per_key, rated, klim
    FROM leash.queues qq WHERE qq.name = q AND current_setting('leash.capped_claim', true) = mark;
    IF per_key IS NULL THEN
        RETURN NULL;
    END IF;
    ids := coalesce(nullif(current_setting('leash.keyed_picked', true), ''), '{}')::bigint[];
    spent := coalesce(nullif(current_setting('leash.keyed_spent', true), ''), '{}')::text[];
    started := (SELECT count(*) FROM leash.jobs j WHERE j.id = ANY (ids) AND j.state = 'running' AND j.attempted_at = now())::integer;
    IF rated THEN
        rate_wait := leash.rate_take(q, mark, started);
    END IF;
    IF klim > 0 AND started > 0 THEN
        -- The starts of each key, newest first, the latest klim of them.
        INSERT INTO leash.key_rates AS r (queue, key, starts)
        SELECT q, t.key, array_fill(now(), ARRAY[least(t.n, klim)])
        FROM (SELECT j.concurrency_key AS key, count(*)::integer AS n FROM leash.jobs j
              WHERE j.id = ANY (ids) AND j.state = 'running' AND j.attempted_at = now() AND j.concurrency_key IS NOT NULL
              GROUP BY j.concurrency_key) t
        ON CONFLICT (queue, key) DO UPDATE
            SET starts = CASE WHEN cardinality(r.starts) = 0 OR now() >= r.starts[1]
                              THEN (excluded.starts || r.starts)[1:klim]
                              ELSE ARRAY(SELECT s.at FROM unnest(excluded.starts || r.starts) AS s(at) ORDER BY s.at DESC LIMIT klim)
                         END;
    END IF;
    IF cardinality(spent) > 0 AND started = cardinality(ids) THEN
        DELETE FROM leash.concurrency_keys c WHERE c.queue = q AND c.key = ANY (spent);
        ks := coalesce(nullif(current_setting('leash.keyed_redo', true), ''), '{}')::text[];
    ELSE
        ks := coalesce(nullif(current_setting('leash.keyed_walked', true), ''), '{}')::text[];
    END IF;
    IF cardinality(ks) > 0 THEN
        PERFORM leash.refresh_keys(q, ks, per_key);
    END IF;
    SELECT min(c.next_run_at) INTO due FROM leash.concurrency_keys c
    WHERE c.queue = q AND c.next_run_at > now() AND c.next_run_at < 'infinity';
    IF due IS NOT NULL AND (rate_wait IS NULL OR rate_wait <= 0 OR extract(epoch FROM due - now()) * 1000 < rate_wait) THEN
        RETURN extract(epoch FROM due - now()) * 1000;
    END IF;
    IF rate_wait > 0 THEN
        RETURN rate_wait;
    END IF;
    RETURN NULL;
END;
$$;

-- 025's last step of the claim, for a worker of a release between 025 and this one.
CREATE OR REPLACE FUNCTION leash.claim_keyed_done(q text, mark text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM leash.claim_keyed_finish(q, mark);
END;
$$;

-- Deletes up to batch rows of leash.key_rates whose starts all left their queue's window more
-- than a minute ago (a claim whose transaction began a moment before, its now() earlier, still
-- counts what its own window holds), or whose queue no longer has a per-key rate limit, skipping
-- rows a claim holds; and up to batch entries of leash.key_wakes of queues no longer claimed key
-- by key (a repeatable read or serializable writer appends them while any queue has a per-key
-- limit, see leash.wake_concurrency_keys). Returns how many rows of leash.key_rates. Called by
-- retention.
CREATE OR REPLACE FUNCTION leash.delete_idle_key_rates(batch integer) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH idle AS (
        SELECT r.queue, r.key FROM leash.key_rates r
        LEFT JOIN leash.queues qq ON qq.name = r.queue
        WHERE qq.key_rate_limit IS NULL
           OR cardinality(r.starts) = 0
           OR r.starts[1] <= now() - leash.rate_window(qq.key_rate_period) - interval '1 minute'
        LIMIT greatest(batch, 0)
        FOR UPDATE OF r SKIP LOCKED
    ), gone AS (
        DELETE FROM leash.key_rates r USING idle WHERE r.queue = idle.queue AND r.key = idle.key
        RETURNING 1
    ), stray AS (
        DELETE FROM leash.key_wakes w
        WHERE w.ctid = ANY (ARRAY(
            SELECT x.ctid FROM leash.key_wakes x
            WHERE NOT EXISTS (SELECT FROM leash.queues qq WHERE qq.name = x.queue
                              AND (qq.max_running_per_key IS NOT NULL OR qq.key_rate_limit IS NOT NULL))
            LIMIT greatest(batch, 0)))
    )
    SELECT count(*)::integer FROM gone
$$;

REVOKE ALL ON FUNCTION leash.delete_idle_key_rates(integer) FROM PUBLIC;

-- The queue's rate limit of 025, its period read as the time it spans (leash.rate_window): a
-- period mixing years, months or days moved the ring's starts by the calendar, not by its span.
CREATE OR REPLACE FUNCTION leash.rate_room(q text, mark text, want integer) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lim integer;
    per interval;
    h   bigint;
    n   integer;
BEGIN
    SELECT qq.rate_limit, leash.rate_window(qq.rate_period) INTO lim, per
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
    WHERE s.started_at > now() - per;
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
    SELECT qq.rate_limit, leash.rate_window(qq.rate_period) INTO lim, per
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

