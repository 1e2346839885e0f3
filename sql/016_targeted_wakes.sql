-- leash 016: an insert wakes as many waiting workers as its rows need, not every worker of the
-- queue. Until now every waiting worker of a queue heard job_available and claimed: with 32 idle
-- worker processes, one job cost 32 claims. A worker now registers with a wake channel of its
-- own (leash_wake_ and 16 hex digits, which only it LISTENs on) and its free slots; the insert
-- trigger picks waiters of the queue, marks them woken and notifies each on its channel with the
-- queue's name, until their free slots cover the statement's runnable rows.
-- A wake is a hint. A picked waiter stays marked (woken_at) until it claims or refreshes its
-- registration, so a dead, stopped or stuck worker is picked once, not again (only while no
-- other waiter is left, within a second of its pick, is it notified once more), and its row
-- expires; every waiter still polls, so a job whose wake went nowhere waits at most for the next
-- poll of another waiter. Rows are picked FOR NO KEY UPDATE SKIP LOCKED: concurrent inserters
-- pick different waiters and never wait for each other on leash.waiters, and the mark is undone
-- with the insert if it rolls back. Marking a waiter changes only woken_at, which no longer fires
-- the registrations' trigger (the waiting hint depends on expires_at alone), so the insert path
-- takes no lock on leash.waiting_hint_lock and writes no WAL for it (leash.waiters is unlogged).
-- job_available keeps its contract: a queue's name on it means "some job of this queue is
-- available" to any listener, and the other paths (retry_job, resume, room freed, hand-back,
-- rescue) still send it.
-- Safe to apply while workers of the previous release run: they register with the same
-- statements, which leave the new columns NULL; while such a registration of a queue is live,
-- inserts into that queue notify job_available as before (every worker, old or new, hears it),
-- so nobody waits longer than before. The columns are added without a default (a catalog
-- change); the index and the constraint are built on a small unlogged table.

ALTER TABLE leash.waiters
    -- The channel only this waiter LISTENs on; NULL: a worker of an earlier release, woken by
    -- job_available.
    ADD COLUMN IF NOT EXISTS wake_channel text,
    -- The waiter's free slots at its registration: how many jobs one wake may be for.
    ADD COLUMN IF NOT EXISTS slots integer,
    -- When an insert last picked this waiter; NULL while it may be picked. Cleared by the waiter
    -- when it claims again or refreshes its registration with its listener connected.
    ADD COLUMN IF NOT EXISTS woken_at timestamptz;

-- A channel the trigger notifies must be a waiter's own: never job_revoked, queue_changed or
-- another contract channel, whoever wrote the row.
ALTER TABLE leash.waiters DROP CONSTRAINT IF EXISTS waiters_wake_channel_check;
ALTER TABLE leash.waiters ADD CONSTRAINT waiters_wake_channel_check
    CHECK (wake_channel IS NULL OR wake_channel ~ '^leash_wake_[0-9a-f]{16}$');

-- The waiters an insert may pick, in the order it picks them: the scan passes over no waiter
-- already woken.
CREATE INDEX IF NOT EXISTS waiters_wakeable_idx ON leash.waiters (queue, waiter)
    WHERE wake_channel IS NOT NULL AND woken_at IS NULL;

-- The waiting hint follows expires_at: marking a waiter woken (in the inserting transaction)
-- must not take the hint's lock.
DROP TRIGGER IF EXISTS waiters_changed ON leash.waiters;
CREATE TRIGGER waiters_changed
    AFTER INSERT OR UPDATE OF expires_at OR DELETE OR TRUNCATE ON leash.waiters
    FOR EACH STATEMENT EXECUTE FUNCTION leash.set_waiting_until();

-- The insert trigger's function: as in 014 (skipped when the notification queue is over half
-- full; only queues with a live waiter that could claim now), then, per queue, job_available
-- when a worker of an earlier release waits on it, else wakes for its waiters until their free
-- slots cover the queue's runnable rows.
CREATE OR REPLACE FUNCTION leash.notify_job_available() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q    text;
    need bigint;
    ch   text;
    sl   integer;
    w    refcursor;
    sent boolean;
BEGIN
    IF pg_notification_queue_usage() > 0.5 THEN
        RETURN NULL;
    END IF;
    FOR q, need IN
        SELECT d.queue, d.n FROM (
            SELECT n.queue, count(*) AS n FROM new_jobs n
            WHERE n.state IN ('available', 'retryable') AND n.run_at <= now()
            GROUP BY n.queue
        ) d
        WHERE EXISTS (SELECT FROM leash.waiters w WHERE w.queue = d.queue AND w.expires_at > now())
          AND NOT EXISTS (
              SELECT FROM leash.queues c WHERE c.name = d.queue
                AND CASE WHEN c.paused_at IS NOT NULL THEN true
                         WHEN c.max_running IS NULL THEN false
                         ELSE (SELECT count(*) FROM (SELECT FROM leash.jobs j WHERE j.queue = c.name
                                                     AND j.state = 'running' LIMIT c.max_running) r) >= c.max_running
                    END)
    LOOP
        IF EXISTS (SELECT FROM leash.waiters w
                   WHERE w.queue = q AND w.wake_channel IS NULL AND w.expires_at > now()) THEN
            -- A worker of an earlier release waits: it hears only job_available.
            sent := pg_notify('job_available', q) IS NOT NULL;
            CONTINUE;
        END IF;
        -- One row at a time (FETCH), so that only the waiters notified are locked.
        OPEN w FOR
            SELECT x.wake_channel, x.slots FROM leash.waiters x
            WHERE x.queue = q AND x.wake_channel IS NOT NULL AND x.woken_at IS NULL AND x.expires_at > now()
            ORDER BY x.queue, x.waiter
            FOR NO KEY UPDATE SKIP LOCKED;
        LOOP
            FETCH w INTO ch, sl;
            EXIT WHEN NOT FOUND;
            UPDATE leash.waiters SET woken_at = now() WHERE CURRENT OF w;
            sent := pg_notify(ch, q) IS NOT NULL;
            need := need - greatest(coalesce(sl, 1), 1);
            EXIT WHEN need <= 0;
        END LOOP;
        CLOSE w;
        IF need > 0 THEN
            -- Every waiter is picked already: notify again those picked within the last second,
            -- most recent first. They are claiming or about to (a claim in flight may have
            -- missed these rows: a wake while it runs makes them claim again); one picked longer
            -- ago that has not claimed since is taken for gone and never notified again.
            OPEN w FOR
                SELECT x.wake_channel, x.slots FROM leash.waiters x
                WHERE x.queue = q AND x.wake_channel IS NOT NULL AND x.expires_at > now()
                  AND x.woken_at > now() - interval '1 second'
                ORDER BY x.woken_at DESC
                FOR NO KEY UPDATE SKIP LOCKED;
            LOOP
                FETCH w INTO ch, sl;
                EXIT WHEN NOT FOUND;
                sent := pg_notify(ch, q) IS NOT NULL;
                need := need - greatest(coalesce(sl, 1), 1);
                EXIT WHEN need <= 0;
            END LOOP;
            CLOSE w;
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.notify_job_available() FROM PUBLIC;
