-- leash 019: an idle fleet polls as one, and no insert's wake is lost to a concurrent one.
--
-- Polls. Every waiting worker claimed at every poll (each PollInterval), so an idle fleet of 32
-- made 32 empty claims a second to bound what no notification announces (a retry or a delayed
-- job coming due, a wake that went nowhere). A waiter now records when it claimed for its poll
-- (polled_at), and a waiter whose queues were all claimed for a poll by another live waiter
-- within half a poll interval refreshes its registration but does not claim: the fleet claims
-- about twice per poll interval, whatever its size, and a job no notification announces still
-- waits at most about one poll interval. Every tenth poll of a worker claims regardless, so a
-- row written with a forged poll time costs at most ten poll intervals; a poll time in the
-- future covers nothing.
--
-- Wakes. An insert picks waiters FOR NO KEY UPDATE SKIP LOCKED (016), so two inserts committing
-- at once pick different waiters. When every waiter of the queue was locked by the other
-- insert, the second one fell back to those picked within the last second, which did not
-- include the waiter the first insert was picking (its mark not yet committed): the second job
-- woke nobody and waited for a poll. A worker that goes straight back to waiting after a claim
-- that found work (rather than polling for a while) would meet this at every pair of concurrent
-- inserts. The fallback now reads waiters without a lock and notifies those another inserter is
-- picking as well: a waiter may hear two wakes for one claim, never none.
--
-- Safe to apply while workers of earlier releases run: they never set polled_at, so they cover
-- no one's poll and claim at every poll of their own as before; the insert trigger's contract is
-- unchanged (an extra wake is a hint like any other, and the wake gate holds back those that
-- lead to nothing); the column is added without a default (a catalog change) to a small
-- unlogged table.

ALTER TABLE leash.waiters
    -- When this waiter last claimed for its poll (database clock); NULL: never, or a worker of
    -- an earlier release.
    ADD COLUMN IF NOT EXISTS polled_at timestamptz;

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
            -- Every waiter this statement could lock is picked already: notify, without a lock
            -- (a plain read never waits), those another inserter is picking right now (their
            -- rows were skipped as locked; they read as not woken) first, then those picked
            -- within the last second, most recent first. They are claiming or about to (a claim
            -- in flight may have missed these rows: a wake while it runs makes them claim
            -- again); one picked longer ago that has not claimed since is taken for gone and
            -- never notified again.
            OPEN w FOR
                SELECT x.wake_channel, x.slots FROM leash.waiters x
                WHERE x.queue = q AND x.wake_channel IS NOT NULL AND x.expires_at > now()
                  AND (x.woken_at IS NULL OR x.woken_at > now() - interval '1 second')
                ORDER BY x.woken_at DESC NULLS FIRST;
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
