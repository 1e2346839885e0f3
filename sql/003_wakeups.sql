-- leash 003: wake-ups on demand. An insert notifies job_available only when some worker of that
-- queue is waiting for work: busy workers claim again as slots free and need no wake-up, and a
-- transaction that sends a NOTIFY commits alone (PostgreSQL serializes notifying commits), so
-- notifying every insert would cap concurrent producers far below what the table can take.
-- Safe to apply while workers of the previous release run: they do not register, so they are no
-- longer woken by inserts and pick work up by polling (WORKER_POLL_INTERVAL) until replaced.

-- Workers waiting for work, one row per queue and worker. Unlogged: it is rebuilt by the workers
-- within a poll interval after a crash, and a registration costs no WAL. A worker's rows expire
-- (expires_at) so that a dead worker costs nothing; live ones refresh theirs while they wait.
CREATE UNLOGGED TABLE leash.waiters (
    queue      text        NOT NULL,
    waiter     text        NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (queue, waiter)
);

-- Whoever inserts jobs runs the trigger below, which reads this table.
GRANT SELECT ON leash.waiters TO PUBLIC;

-- One job_available notification per distinct queue of runnable rows per statement, however many
-- rows it inserted, and only for queues a live worker waits on. Skipped when the notification
-- queue is over half full, so that a stuck listener can never make inserts fail: workers poll as
-- well.
CREATE OR REPLACE FUNCTION leash.notify_job_available() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    -- The common case under load, first and cheapest: nobody waits.
    IF NOT EXISTS (SELECT FROM leash.waiters w WHERE w.expires_at > now()) THEN
        RETURN NULL;
    END IF;
    IF pg_notification_queue_usage() > 0.5 THEN
        RETURN NULL;
    END IF;
    FOR q IN
        SELECT d.queue FROM (
            SELECT DISTINCT n.queue FROM new_jobs n
            WHERE n.state IN ('available', 'retryable') AND n.run_at <= now()
        ) d
        WHERE EXISTS (SELECT FROM leash.waiters w WHERE w.queue = d.queue AND w.expires_at > now())
    LOOP
        PERFORM leash.notify_available(q);
    END LOOP;
    RETURN NULL;
END;
$$;
