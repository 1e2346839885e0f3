-- leash 021: workflow rows are deleted by retention once their jobs are; a workflow's counts
-- survive its dependencies being put back; revoke_workflow misses nothing committed meanwhile.
--
-- Retention. A workflow's row stayed forever. Retention now deletes it once it has no jobs left
-- (leash.delete_empty_workflows, called by workers with the jobs' retention): its DELETE sets
-- leash.workflow_retention, and the row trigger then skips a workflow that has jobs instead of
-- refusing the statement. A
-- transaction inserting a job into a workflow now holds the workflow's row FOR KEY SHARE until it
-- ends (as a foreign key would): a DELETE of the row waits for it and then sees its job, and
-- retention (FOR UPDATE SKIP LOCKED) passes it by. Before, a DELETE beside an insert saw no job
-- (not yet committed) and both committed: a job of no workflow.
--
-- Counts. A pending job counts the dependencies it still waits for (unmet) and each completion
-- counts one off. A dependency that had counted as met (completed, or failed or cancelled while
-- may_fail) and is put back in the queue (retry_job of a may_fail job that failed, or an UPDATE by
-- hand) was counted off again at its next completion: its dependents were released while others
-- of their dependencies still ran. The jobs still pending now wait for it again (unmet + 1).
--
-- Pending by hand. An UPDATE from outside a trigger that takes a pending job to available,
-- retryable or running is refused, as one of unmet is: the job would run before its
-- dependencies completed. Cancelling or finishing one by hand stays allowed.
--
-- Deleted dependencies. A job put back by the retry of another of its dependencies, one of whose
-- dependencies had been deleted (after it completed), waited for it forever, and retention kept
-- its whole workflow: it is now cancelled, naming the step.
--
-- Revocation. leash.revoke_workflow's statement sees the jobs committed before it started: a job
-- a fan-out inserted, or a failed one retry_job put back, committed while it ran, escaped it. It
-- now repeats its update, each time for the jobs it has not revoked yet, until one finds none.
--
-- Safe to apply while workers of the previous release run: only functions and triggers are
-- replaced or added, in one transaction. Those workers never delete workflow rows, never set a
-- pending job's state, and write outcomes through the same triggers; their inserts into a
-- workflow now lock its row FOR KEY SHARE, which stops only a DELETE or a FOR UPDATE of that row
-- (retention skips it). A worker of this release whose role lacks EXECUTE on
-- leash.delete_empty_workflows (granted as docs/sql.md listed before) keeps workflow rows, and
-- warns once.

-- A job joins its workflow (insert), or waits for more steps (depends_on grows), as in 020; an
-- insert now locks the workflow's row FOR KEY SHARE (once per transaction and workflow): a
-- DELETE of the row waits for the inserting transaction and then sees its job.
CREATE OR REPLACE FUNCTION leash.workflow_job_written() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    added text[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.unmet := NULL; -- counted here and at the commit, never taken from the writer
        IF NEW.workflow_id IS NULL THEN
            RETURN NEW; -- jobs_workflow_check refuses steps and dependencies without a workflow
        END IF;
        -- The common case of a large workflow kept short: the row is locked once per transaction
        -- and workflow (the setting is the transaction's, and a rolled back savepoint takes both
        -- the lock and the setting back).
        IF current_setting('leash.workflow_exists', true) IS DISTINCT FROM NEW.workflow_id::text THEN
            PERFORM FROM leash.workflows w WHERE w.id = NEW.workflow_id FOR KEY SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'workflow % does not exist', NEW.workflow_id USING ERRCODE = 'foreign_key_violation';
            END IF;
            PERFORM set_config('leash.workflow_exists', NEW.workflow_id::text, true);
        END IF;
        IF NEW.depends_on IS NULL THEN
            IF NEW.state = 'pending' THEN
                NEW.state := 'available'; -- nothing to wait for
            END IF;
            RETURN NEW;
        END IF;
        SELECT array_agg(DISTINCT x) INTO added FROM unnest(NEW.depends_on) x;
    ELSE
        IF NEW.workflow_id IS DISTINCT FROM OLD.workflow_id OR NEW.step IS DISTINCT FROM OLD.step THEN
            RAISE EXCEPTION 'job %: a job''s workflow and step cannot change', NEW.id
                USING ERRCODE = 'check_violation';
        END IF;
        IF EXISTS (SELECT unnest(OLD.depends_on) EXCEPT SELECT unnest(NEW.depends_on)) THEN
            RAISE EXCEPTION 'job %: dependencies can be added, never removed', NEW.id
                USING ERRCODE = 'check_violation';
        END IF;
        SELECT array_agg(x) INTO added FROM (SELECT unnest(NEW.depends_on) EXCEPT SELECT unnest(OLD.depends_on)) s(x);
        IF added IS NOT NULL AND OLD.state NOT IN ('pending', 'available', 'retryable') THEN
            RAISE EXCEPTION 'job % is %: it cannot wait for more steps', NEW.id, OLD.state
                USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.workflow_id IS NULL THEN
            RETURN NEW;
        END IF;
    END IF;
    IF added IS NULL THEN
        IF TG_OP = 'INSERT' AND NEW.state = 'pending' THEN
            NEW.state := 'available'; -- nothing to wait for
        END IF;
        RETURN NEW;
    END IF;
    IF EXISTS (SELECT FROM unnest(added) x WHERE x IS NULL OR x = '' OR octet_length(x) > 1024) THEN
        RAISE EXCEPTION 'job % (step %): a dependency names no step (NULL, empty or longer than 1024 bytes)',
            NEW.id, left(NEW.step, 200) USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO leash.workflow_edges (workflow_id, step, job_id)
    SELECT NEW.workflow_id, x, NEW.id FROM unnest(added) x
    ON CONFLICT DO NOTHING;
    IF NEW.state IN ('pending', 'available', 'retryable') THEN
        NEW.state := 'pending';
        NEW.unmet := coalesce(NEW.unmet, 0) + cardinality(added);
    END IF;
    RETURN NEW;
END;
$$;

-- As in 020, and: a job one of whose dependencies no longer exists (deleted by hand, or by the
-- retention of a release that did not know workflows, after it completed) is cancelled, naming
-- it, instead of waiting for it forever. It is reached when a retry of another dependency puts
-- back the job that dependency's failure had cancelled; an insert or a retry_job naming a step
-- that does not exist is refused before (leash.check_workflow_graph, leash.workflow_job_retried).
CREATE OR REPLACE FUNCTION leash.settle_workflow_job(job_id bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_custom_plan SET enable_seqscan = off AS $$
DECLARE
    wid   bigint;
    deps  text[];
    st    text;
    left_ integer;
    bad   record;
    gone  text;
BEGIN
    SELECT j.workflow_id, j.depends_on, j.state INTO wid, deps, st FROM leash.jobs j WHERE j.id = job_id;
    IF NOT FOUND OR st <> 'pending' THEN
        RETURN;
    END IF;
    IF cardinality(deps) > 100 THEN
        -- Planning for thousands of values costs more than the plan saves.
        PERFORM set_config('plan_cache_mode', 'force_generic_plan', true);
    END IF;
    -- Rows this very transaction inserted (not in a savepoint) need no lock: no other
    -- transaction sees them before it commits.
    PERFORM FROM unnest(deps) s(step) JOIN leash.jobs d ON d.workflow_id = wid AND d.step = s.step
    WHERE d.state NOT IN ('completed', 'failed', 'cancelled')
      AND d.xmin::text <> (pg_current_xact_id()::text::bigint % 4294967296)::text
    ORDER BY d.id
    FOR KEY SHARE OF d;
    SELECT s.step INTO gone FROM unnest(deps) s(step)
    WHERE NOT EXISTS (SELECT FROM leash.jobs d WHERE d.workflow_id = wid AND d.step = s.step)
    LIMIT 1;
    IF FOUND THEN
        UPDATE leash.jobs j SET state = 'cancelled', finished_at = now(), unmet = greatest(coalesce(j.unmet, 1), 1),
            last_error = format('dependency %s no longer exists', left(gone, 200))
        WHERE j.id = job_id;
        RETURN;
    END IF;
    SELECT d.step, d.id, d.state INTO bad FROM unnest(deps) s(step) JOIN leash.jobs d ON d.workflow_id = wid AND d.step = s.step
    WHERE d.state IN ('failed', 'cancelled') AND NOT coalesce(d.may_fail, false)
    LIMIT 1;
    IF FOUND THEN
        UPDATE leash.jobs j SET state = 'cancelled', finished_at = now(), unmet = greatest(coalesce(j.unmet, 1), 1),
            last_error = format('dependency %s (job %s) %s', left(bad.step, 200), bad.id, bad.state)
        WHERE j.id = job_id;
        RETURN;
    END IF;
    SELECT count(*) INTO left_ FROM (SELECT DISTINCT x FROM unnest(deps) x) s
    WHERE NOT EXISTS (SELECT FROM leash.jobs d WHERE d.workflow_id = wid AND d.step = s.x
                        AND (d.state = 'completed' OR (d.state IN ('failed', 'cancelled') AND coalesce(d.may_fail, false))));
    IF left_ > 0 THEN
        UPDATE leash.jobs j SET unmet = left_ WHERE j.id = job_id AND j.unmet IS DISTINCT FROM left_;
        RETURN;
    END IF;
    UPDATE leash.jobs j SET state = 'available', unmet = 0 WHERE j.id = job_id;
    PERFORM leash.wake_released(ARRAY[q.queue]) FROM leash.jobs q WHERE q.id = job_id AND q.run_at <= now();
END;
$$;


REVOKE ALL ON FUNCTION leash.settle_workflow_job(bigint) FROM PUBLIC;

-- A workflow's row is deleted only once it has no jobs left. The row is locked before this runs
-- (a DELETE locks it first), so a transaction inserting a job into it (FOR KEY SHARE, see
-- leash.workflow_job_written) has ended, and its job is seen here. A DELETE of one that has jobs
-- is refused; retention's (leash.workflow_retention on) passes it by instead.
CREATE OR REPLACE FUNCTION leash.workflow_deleted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT FROM leash.jobs j WHERE j.workflow_id = OLD.id) THEN
        IF current_setting('leash.workflow_retention', true) = 'on' THEN
            RETURN NULL;
        END IF;
        RAISE EXCEPTION 'workflow % still has jobs: it can be deleted once they are (revoke it, and retention deletes them once finished)', OLD.id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN OLD;
END;
$$;

-- As in 020, and: a job put back in the queue after it had counted as met for the jobs waiting
-- for it (completed, or failed or cancelled while may_fail) is waited for again by those still
-- pending (their unmet grows by one), so that its next completion does not count it off twice.
-- Jobs it released already stay released.
CREATE OR REPLACE FUNCTION leash.workflow_job_finished() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $$
DECLARE
    r    record;
    prev text := leash.bound_outcome_lock_wait();
BEGIN
    IF NEW.state IN ('completed', 'failed', 'cancelled') THEN
        PERFORM FROM leash.jobs j WHERE j.id = NEW.id FOR UPDATE;
        WITH RECURSIVE down(id) AS (
            SELECT e.job_id FROM leash.workflow_edges e
            WHERE e.workflow_id = NEW.workflow_id AND e.step = NEW.step
            UNION
            SELECT e.job_id FROM down
            JOIN leash.jobs j ON j.id = down.id
            JOIN leash.workflow_edges e ON e.workflow_id = j.workflow_id AND e.step = j.step
            WHERE j.state = 'pending' AND NOT coalesce(j.may_fail, false)
        )
        UPDATE leash.jobs j
        SET state = 'cancelled', finished_at = now(), unmet = greatest(coalesce(j.unmet, 1), 1),
            last_error = format('dependency %s (job %s) %s', left(NEW.step, 200), NEW.id, NEW.state)
        FROM down WHERE j.id = down.id AND j.state = 'pending';
    ELSE
        IF OLD.state = 'completed' OR (coalesce(OLD.may_fail, false) AND OLD.state IN ('failed', 'cancelled')) THEN
            WITH locked AS (
                SELECT d.id FROM leash.workflow_edges e JOIN leash.jobs d ON d.id = e.job_id
                WHERE e.workflow_id = NEW.workflow_id AND e.step = NEW.step AND d.state = 'pending'
                ORDER BY d.id
                FOR NO KEY UPDATE OF d
            )
            UPDATE leash.jobs d SET unmet = coalesce(d.unmet, 0) + 1
            FROM locked l WHERE d.id = l.id AND d.state = 'pending';
        END IF;
        FOR r IN
            WITH RECURSIVE up(id) AS (
                SELECT j.id FROM leash.workflow_edges e JOIN leash.jobs j ON j.id = e.job_id
                WHERE e.workflow_id = NEW.workflow_id AND e.step = NEW.step
                  AND j.state = 'cancelled' AND j.unmet > 0 AND j.revoked_at IS NULL
                UNION
                SELECT j.id FROM up
                JOIN leash.jobs u ON u.id = up.id
                JOIN leash.workflow_edges e ON e.workflow_id = u.workflow_id AND e.step = u.step
                JOIN leash.jobs j ON j.id = e.job_id
                WHERE j.state = 'cancelled' AND j.unmet > 0 AND j.revoked_at IS NULL
            ),
            back AS (
                UPDATE leash.jobs j SET state = 'pending', finished_at = NULL, last_error = NULL
                FROM up WHERE j.id = up.id AND j.state = 'cancelled'
                RETURNING j.id
            )
            SELECT back.id FROM back ORDER BY back.id
        LOOP
            PERFORM leash.settle_workflow_job(r.id);
        END LOOP;
    END IF;
    IF prev IS NOT NULL THEN
        PERFORM set_config('lock_timeout', prev, true);
    END IF;
    RETURN NULL;
END;
$$;

-- A pending job leaves pending through leash's triggers alone (its release), or by finishing
-- (cancelled, revoked, or completed or failed by hand): an UPDATE from outside a trigger
-- (pg_trigger_depth() 0) that makes it available, retryable or running is refused.
CREATE OR REPLACE FUNCTION leash.workflow_pending_written() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'job % is pending: it runs once its dependencies completed, and cannot be made % by hand', NEW.id, NEW.state
        USING ERRCODE = 'check_violation';
END;
$$;

REVOKE ALL ON FUNCTION leash.workflow_pending_written() FROM PUBLIC;

CREATE OR REPLACE TRIGGER jobs_workflow_pending
    BEFORE UPDATE OF state ON leash.jobs
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'pending' AND NEW.state IN ('available', 'retryable', 'running')
          AND pg_catalog.pg_trigger_depth() OPERATOR(pg_catalog.=) 0)
    EXECUTE FUNCTION leash.workflow_pending_written();

-- As in 020, repeated: each further update is for the unfinished jobs of the workflow not
-- revoked yet, and sees what committed since the one before (a fan-out's job, a failed job
-- retry_job put back); it stops once one finds none. A fan-out of a job this revoked commits no
-- more (its fenced commit sees the revocation).
CREATE OR REPLACE FUNCTION leash.revoke_workflow(wid bigint, reason text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    m integer;
BEGIN
    WITH r AS (
        UPDATE leash.jobs j
        SET revoked_at = coalesce(j.revoked_at, now()),
            revoke_reason = CASE WHEN j.revoked_at IS NULL THEN reason ELSE j.revoke_reason END
        WHERE j.workflow_id = wid AND j.state IN ('pending', 'available', 'retryable', 'running')
        RETURNING j.id, j.state, j.lease_token, j.revoke_reason, j.revoked_at
    )
    SELECT count(*) INTO n FROM r
    WHERE CASE WHEN r.state = 'running' AND r.revoked_at IS DISTINCT FROM now()
               THEN leash.notify_revoked(r.id, r.lease_token, r.revoke_reason) IS NOT NULL
               ELSE true END;
    LOOP
        UPDATE leash.jobs j SET revoked_at = now(), revoke_reason = reason
        WHERE j.workflow_id = wid AND j.state IN ('pending', 'available', 'retryable', 'running')
          AND j.revoked_at IS NULL;
        GET DIAGNOSTICS m = ROW_COUNT;
        EXIT WHEN m = 0;
        n := n + m;
    END LOOP;
    RETURN n;
END;
$$;

REVOKE ALL ON FUNCTION leash.revoke_workflow(bigint, text) FROM PUBLIC;

-- Retention of workflow rows: deletes up to n rows of workflows created more than older_than ago
-- that have no jobs left, lowest id first, and returns how many. Rows a transaction inserting a
-- job holds FOR KEY SHARE are passed by (SKIP LOCKED); one whose job committed after the
-- statement began is passed by as well (the row trigger sees the job and, with
-- leash.workflow_retention on, skips the row rather than failing the statement). It runs with
-- the owner's rights, so that workers need no right to lock or delete workflow rows themselves:
-- only roles granted EXECUTE may call it.
CREATE OR REPLACE FUNCTION leash.delete_empty_workflows(older_than interval, n integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    m integer;
BEGIN
    PERFORM set_config('leash.workflow_retention', 'on', true);
    WITH gone AS (
        DELETE FROM leash.workflows WHERE id IN (
            SELECT w.id FROM leash.workflows w
            WHERE w.created_at < now() - older_than
              AND NOT EXISTS (SELECT FROM leash.jobs j WHERE j.workflow_id = w.id)
            ORDER BY w.id
            LIMIT n
            FOR UPDATE SKIP LOCKED)
        RETURNING 1
    )
    SELECT count(*) INTO m FROM gone;
    PERFORM set_config('leash.workflow_retention', 'off', true);
    RETURN m;
END;
$$;

REVOKE ALL ON FUNCTION leash.delete_empty_workflows(interval, integer) FROM PUBLIC;
