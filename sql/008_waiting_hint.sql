-- leash 008: an insert skips the wake-up trigger's function while no worker waits. Under load
-- nobody waits (busy workers are not registered), yet every insert ran the PL/pgSQL function only
-- to find that out with a query of leash.waiters: about a tenth of a single-row insert's cost.
-- A sequence now holds, in milliseconds since the epoch, the latest expiry of any registration;
-- the trigger's WHEN reads it with a function call (no query, no lock inserts contend on) and calls
-- the function only while it is in the future. The function still checks each queue's
-- registrations, as before, and now notifies without a SQL function's planning per call.
-- Safe to apply while workers of the previous release run: they register with the same
-- statements, and the trigger on leash.waiters below keeps the hint for them too.

-- The latest expires_at in leash.waiters, as milliseconds since the epoch; 0 when there is none.
-- Maintained by the trigger below, never by hand.
CREATE SEQUENCE IF NOT EXISTS leash.waiting_until AS bigint MINVALUE 0 START 0;

-- Whoever inserts jobs reads it in the trigger's WHEN.
GRANT SELECT ON SEQUENCE leash.waiting_until TO PUBLIC;

-- Sets leash.waiting_until from the registrations. Called after every statement that changes
-- them. A setval is seen at once, before the registration commits, so the hint is never behind a
-- registration an insert could see. Runs as its owner, so that workers need no right on the
-- sequence, and serialized by a transaction-level advisory lock ("leashwt" in ASCII): of two
-- workers changing their registrations at once, the one that sets the hint last has seen the
-- other's committed rows. Infinite expiries (hand-made rows) are clamped.
-- The lock is waited for at most a second: anyone may take an advisory lock, and a worker whose
-- registration fails polls. setval writes WAL, so a registration's commit now waits for a WAL
-- flush (leash.waiters alone is unlogged); registrations come from idle workers only.
-- Under REPEATABLE READ (a role's default_transaction_isolation) the snapshot predates the lock,
-- and a concurrent registration can be missed until its worker refreshes it at its next poll.
CREATE OR REPLACE FUNCTION leash.set_waiting_until() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    PERFORM pg_advisory_xact_lock(30510766707210100);
    PERFORM setval('leash.waiting_until', (
        SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
        FROM leash.waiters w));
    RETURN NULL;
END;
$$;

-- Only its trigger runs it (it runs with its owner's rights).
REVOKE ALL ON FUNCTION leash.set_waiting_until() FROM PUBLIC;

DROP TRIGGER IF EXISTS waiters_changed ON leash.waiters;
CREATE TRIGGER waiters_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON leash.waiters
    FOR EACH STATEMENT EXECUTE FUNCTION leash.set_waiting_until();

-- The registrations already there (workers of the previous release waiting now).
SELECT setval('leash.waiting_until', (
    SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
    FROM leash.waiters w));

-- The trigger's function, for when some worker may wait: the queues of this statement's runnable
-- rows that a live registration waits on, one notification each. pg_notify is called directly
-- (an expression, evaluated in place) rather than through leash.notify_available, a SQL function
-- whose body PostgreSQL plans again at every call: a single-row insert's trigger went from about
-- 110 us to about 30 us, and it lies on the way from an idle worker's insert to its pickup.
CREATE OR REPLACE FUNCTION leash.notify_job_available() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q    text;
    sent boolean;
BEGIN
    -- Skipped when the notification queue is over half full, so that a stuck listener can never
    -- make inserts fail: workers poll as well.
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
        sent := pg_notify('job_available', q) IS NOT NULL;
    END LOOP;
    RETURN NULL;
END;
$$;

-- The same trigger, called only while some registration may be live. now() is the inserting
-- transaction's start: a long transaction compares an earlier time, so it calls the function more
-- often, never less.
DROP TRIGGER jobs_notify_available ON leash.jobs;
CREATE TRIGGER jobs_notify_available
    AFTER INSERT ON leash.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT
    WHEN (pg_catalog.pg_sequence_last_value('leash.waiting_until'::regclass)::double precision
          OPERATOR(pg_catalog.>)
          (pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000::double precision))
    EXECUTE FUNCTION leash.notify_job_available();
