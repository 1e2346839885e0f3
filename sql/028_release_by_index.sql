-- leash 028: a workflow's release reads the jobs waiting for the completed ones by index, whatever
-- the statistics say.
--
-- At the end of an outcome statement that completed jobs of workflows, leash.release_completed
-- joins the completed steps to leash.workflow_edges. With statistics that count a few thousand
-- edges (one fan-out of 10,000 in a fresh database), PostgreSQL planned that join as a hash of the
-- completed steps over a sequential scan of every edge of every workflow: each outcome batch of a
-- fan-out's children read all 10,000 edges (2.4 ms of a 2.8 ms release of 100 completions), so a
-- release cost what the table holds, not what it releases. The join is now one probe of the
-- edges' primary key per completed job, under any statistics. (Turning sequential scans off for
-- the function instead made the planner read whole indexes elsewhere: 14 times slower.)
--
-- Safe to apply while workers of earlier releases run: the function is replaced in one
-- statement and does what it did, by another plan.

CREATE OR REPLACE FUNCTION leash.release_completed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ids      bigint[];
    wids     bigint[];
    steps    text[];
    released text[];
    prev     text;
BEGIN
    PERFORM set_config('leash.workflow_completed', 'off', true);
    WITH done AS (DELETE FROM leash.workflow_completed RETURNING job_id, workflow_id, step)
    SELECT array_agg(job_id), array_agg(workflow_id), array_agg(step) INTO ids, wids, steps FROM done;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    prev := leash.bound_outcome_lock_wait();
    PERFORM FROM leash.jobs j WHERE j.id = ANY (ids) ORDER BY j.id FOR UPDATE;
    WITH waiting AS (
        -- One probe of the edges' primary key per completed job (OFFSET 0 keeps the subquery
        -- from being merged into a join the planner may hash over a scan of every edge).
        SELECT e.job_id, count(*) AS n
        FROM unnest(wids, steps) AS c(workflow_id, step)
        CROSS JOIN LATERAL (
            SELECT x.job_id FROM leash.workflow_edges x
            WHERE x.workflow_id = c.workflow_id AND x.step = c.step
            OFFSET 0
        ) e
        GROUP BY e.job_id
    ), locked AS (
        SELECT d.id, w.n FROM leash.jobs d JOIN waiting w ON w.job_id = d.id
        WHERE d.state = 'pending'
        ORDER BY d.id
        FOR NO KEY UPDATE OF d
    ), rel AS (
        UPDATE leash.jobs d
        SET unmet = greatest(coalesce(d.unmet, 0) - l.n, 0),
            state = CASE WHEN coalesce(d.unmet, 0) <= l.n THEN 'available' ELSE 'pending' END
        FROM locked l
        WHERE d.id = l.id AND d.state = 'pending'
        RETURNING d.queue, d.state, d.run_at
    )
    SELECT array_agg(rel.queue) INTO released FROM rel WHERE rel.state = 'available' AND rel.run_at <= now();
    IF prev IS NOT NULL THEN
        PERFORM set_config('lock_timeout', prev, true);
    END IF;
    PERFORM leash.wake_released(released);
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.release_completed() FROM PUBLIC;
