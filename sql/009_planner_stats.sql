-- leash 009: the planner's statistics of leash.jobs follow its growth. A prepared statement's
-- generic plan is made for the table's size at that moment and kept until the table's statistics
-- change. A queue's table can grow a hundredfold in a minute (a fresh install, a burst after an
-- idle night whose rows VACUUM had cut away), far faster than autovacuum analyzes it (it looks at
-- most once per autovacuum_naptime): meanwhile a plan made for a small table, which hashes a
-- sequential scan of the whole table for a batch of a hundred ids, runs on a large one, and each
-- outcome batch or lease renewal reads every row. Workers call the function below every second
-- or so; it analyzes the table only when it has grown to twice the size its statistics know, so
-- plans are made again (ANALYZE invalidates them in every session) for at most twice the size
-- they were made for.
-- Safe to apply while workers of the previous release run: they do not call it, and autovacuum
-- keeps the statistics for them as before.

-- Analyzes leash.jobs if its main fork holds at least 128 pages (1 MB) and more than twice the
-- pages pg_class records (never analyzed counts as none), and returns whether it did. Cheap when
-- there is nothing to do: a pg_class lookup and the relation's size. Runs as its owner, who must
-- be allowed to analyze the table (its owner, a member of the owning role, the database's owner
-- or a superuser), so that workers need no right on the table; nobody else may call it until
-- granted, since the table lock ANALYZE takes lasts until the caller's transaction ends (a caller
-- could hold it, and keep autovacuum off the table). The sample is read at full speed and with
-- the statistics target the server and database are configured with (as autovacuum's ANALYZE
-- uses), whatever the caller has SET. One call analyzes at a time ("leashan" in ASCII, tried,
-- never waited for); the table lock is waited for at most 100ms (autovacuum holds it while it
-- works, and refreshes the statistics itself).
CREATE OR REPLACE FUNCTION leash.refresh_jobs_stats() RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET vacuum_cost_delay = 0
SET default_statistics_target = 100 -- replaced below; the clause undoes that when the call ends
AS $$
DECLARE
    owner oid;
    known bigint;
    pages bigint;
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
    PERFORM set_config('default_statistics_target',
        (SELECT s.reset_val FROM pg_settings s WHERE s.name = 'default_statistics_target'), true);
    ANALYZE leash.jobs;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END;
$$;

-- Granted like the operators' functions: its owner, the migrating role (which usually runs the
-- workers), may call it; a worker of another role needs
--   GRANT EXECUTE ON FUNCTION leash.refresh_jobs_stats() TO worker;
-- (and so does the migrating role after an ALTER FUNCTION ... OWNER TO another role); without it
-- the worker leaves the statistics to autovacuum, as before this migration.
REVOKE ALL ON FUNCTION leash.refresh_jobs_stats() FROM PUBLIC;
