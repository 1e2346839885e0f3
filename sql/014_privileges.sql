-- leash 014: nothing in schema leash is readable without a grant, the planner-statistics refresh
-- no longer takes its statistics target from the caller, and wake-ups go only to workers that
-- could claim.
-- Safe to apply while workers of the previous release run: they run as the migrating role, which
-- owns every object here and keeps every right; it revokes only what PUBLIC had, replaces
-- function bodies with the same signatures, adds a sequence and a statement trigger that only
-- notifies. Roles other than the owner need the grants the README lists (Privileges) from now on.

-- Reading the tables needs a grant. leash.schedules holds payloads (an http schedule's headers
-- carry API keys), leash.queues and leash.waiters the fleet's queues and worker ids; any role
-- with USAGE on the schema (an operator granted one function) could read them all. Workers read
-- them under the worker role's grants; inserters no longer need leash.waiters, because the
-- insert trigger's function below reads it with its owner's rights.
REVOKE ALL ON leash.schedules FROM PUBLIC;
REVOKE ALL ON leash.queues FROM PUBLIC;
REVOKE ALL ON leash.waiters FROM PUBLIC;
-- leash.waiting_until stays readable by every role: it is a timestamp (the latest expiry of a
-- registration), and the insert trigger's WHEN reads it as the inserting role, so every role
-- that may insert jobs must read it (granted in 008).

-- The latest expires_at of a registration on a capped queue (a row of leash.queues with
-- max_running), as milliseconds since the epoch; 0 when there is none. Maintained by
-- leash.set_waiting_until(), never by hand. Read in the WHEN of jobs_room_freed by every role
-- that changes a job's state, like leash.waiting_until by every role that inserts.
CREATE SEQUENCE IF NOT EXISTS leash.room_waiting_until AS bigint MINVALUE 0 START 0;
GRANT SELECT ON SEQUENCE leash.room_waiting_until TO PUBLIC;

-- Both hints from the registrations: as in 010 (serialized by the owner-only row lock), plus the
-- one of capped queues. A cap set while
-- a worker waits is seen at the worker's next registration (it registers again when it hears of
-- the change, and refreshes its registration at every poll).
CREATE OR REPLACE FUNCTION leash.set_waiting_until() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    PERFORM FROM leash.waiting_hint_lock l WHERE l.singleton FOR UPDATE;
    PERFORM setval('leash.waiting_until', (
        SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
        FROM leash.waiters w));
    PERFORM setval('leash.room_waiting_until', (
        SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
        FROM leash.waiters w JOIN leash.queues c ON c.name = w.queue
        WHERE c.max_running IS NOT NULL));
    RETURN NULL;
END;
$$;

-- The registrations already there.
SELECT setval('leash.room_waiting_until', (
    SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
    FROM leash.waiters w JOIN leash.queues c ON c.name = w.queue
    WHERE c.max_running IS NOT NULL));

-- The insert trigger's function, as in 008, but it notifies a queue only if a worker could claim
-- from it now: an insert into a paused queue, or a capped one at its cap, no longer makes its
-- transaction a notifying one (they commit one at a time) just because a worker waits for
-- another of its queues. Resuming notifies queue_changed; room freed in a capped queue notifies
-- from jobs_room_freed below. Runs with its owner's rights, so that a role that may insert jobs
-- needs no right on leash.waiters or leash.queues; nobody may attach it to a table of their own.
CREATE OR REPLACE FUNCTION leash.notify_job_available() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
          AND NOT EXISTS (
              -- Paused, or capped and at its cap (running jobs counted through
              -- jobs_running_queue_idx, at most max_running of them).
              SELECT FROM leash.queues c WHERE c.name = d.queue
                AND CASE WHEN c.paused_at IS NOT NULL THEN true
                         WHEN c.max_running IS NULL THEN false
                         ELSE (SELECT count(*) FROM (SELECT FROM leash.jobs j WHERE j.queue = c.name
                                                     AND j.state = 'running' LIMIT c.max_running) r) >= c.max_running
                    END)
    LOOP
        sent := pg_notify('job_available', q) IS NOT NULL;
    END LOOP;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.notify_job_available() FROM PUBLIC;

-- Room freed in a capped queue wakes a worker waiting on it: after a statement that changed the
-- state of jobs (an outcome, a rescue, a hand-back, a claim that left room), from a worker of any
-- release or a console, each capped queue that a live worker waits on, that has room now and a
-- runnable job, is notified on job_available. The WHEN reads leash.room_waiting_until (no query):
-- while no worker waits on a capped queue, which is always so on a fleet without caps, the
-- function is not called, and the trigger costs each statement one read of a sequence.
CREATE OR REPLACE FUNCTION leash.notify_room_freed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q    text;
    sent boolean;
BEGIN
    IF pg_notification_queue_usage() > 0.5 THEN
        RETURN NULL;
    END IF;
    FOR q IN
        SELECT c.name FROM leash.queues c
        WHERE c.max_running IS NOT NULL AND c.paused_at IS NULL
          AND EXISTS (SELECT FROM leash.waiters w WHERE w.queue = c.name AND w.expires_at > now())
          AND (SELECT count(*) FROM (SELECT FROM leash.jobs j WHERE j.queue = c.name
                                     AND j.state = 'running' LIMIT c.max_running) r) < c.max_running
          AND EXISTS (SELECT FROM leash.jobs j WHERE j.queue = c.name AND j.state IN ('available', 'retryable')
                      AND j.run_at <= now() AND j.revoked_at IS NULL)
    LOOP
        sent := pg_notify('job_available', q) IS NOT NULL;
    END LOOP;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.notify_room_freed() FROM PUBLIC;

DROP TRIGGER IF EXISTS jobs_room_freed ON leash.jobs;
CREATE TRIGGER jobs_room_freed
    AFTER UPDATE OF state ON leash.jobs
    FOR EACH STATEMENT
    WHEN (pg_catalog.pg_sequence_last_value('leash.room_waiting_until'::regclass)::double precision
          OPERATOR(pg_catalog.>)
          (pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000::double precision))
    EXECUTE FUNCTION leash.notify_room_freed();

-- The planner-statistics refresh, as in 009, but with a statistics target the caller cannot set.
-- 009 used pg_settings.reset_val, which is the caller's own: PGOPTIONS or ALTER ROLE ... SET
-- give it any value from 1 (two-bound histograms, written for every session's plans) to 10000
-- (each refresh samples three million rows). It now uses the database's setting when there is
-- one (ALTER DATABASE ... SET, or ALTER ROLE ALL [IN DATABASE ...] SET: only the database's owner
-- or a superuser can make those), else PostgreSQL's default, 100. A server-wide value from
-- postgresql.conf is not seen: a session cannot tell it from one its client set. Columns'
-- own targets (ALTER TABLE leash.jobs ALTER COLUMN ... SET STATISTICS, which only the table's
-- owner can set) apply as in any ANALYZE, and are the way to give leash.jobs another target.
CREATE OR REPLACE FUNCTION leash.refresh_jobs_stats() RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET vacuum_cost_delay = 0
SET default_statistics_target = 100 -- the default; the database's setting replaces it below
AS $$
DECLARE
    owner  oid;
    known  bigint;
    pages  bigint;
    target text;
BEGIN
    SELECT c.relowner, greatest(c.relpages, 0) INTO owner, known FROM pg_class c WHERE c.oid = 'leash.jobs'::regclass;
    pages := pg_relation_size('leash.jobs'::regclass) / current_setting('block_size')::bigint;
    IF pages < 128 OR pages <= 2 * known THEN
        RETURN false;
    END IF;
    IF NOT (pg_has_role(owner, 'USAGE')
            OR pg_has_role((SELECT d.datdba FROM pg_database d WHERE d.datname = current_database()), 'USAGE')) THEN
        -- ANALYZE would only warn and skip the table, every time it is called.
        RAISE EXCEPTION 'leash.refresh_jobs_stats() belongs to % and may not analyze leash.jobs, which belongs to %',
            current_user, owner::regrole
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'ALTER FUNCTION leash.refresh_jobs_stats() OWNER TO the owner of leash.jobs, then GRANT EXECUTE on it to the workers'' role again';
    END IF;
    IF NOT pg_try_advisory_xact_lock(30510766707204462) THEN
        RETURN false;
    END IF;
    -- The database's own setting first, then the one for every database; never a role's.
    SELECT substr(c.setting, length('default_statistics_target=') + 1) INTO target
    FROM pg_db_role_setting s, unnest(s.setconfig) AS c(setting)
    WHERE s.setrole = 0
      AND s.setdatabase IN (0, (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))
      AND c.setting LIKE 'default\_statistics\_target=%'
    ORDER BY s.setdatabase DESC
    LIMIT 1;
    IF target IS NOT NULL THEN
        PERFORM set_config('default_statistics_target', target, true);
    END IF;
    ANALYZE leash.jobs;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END;
$$;
