-- leash 031: the row triggers that every UPDATE of leash.jobs' state fires carry short WHENs.
--
-- PostgreSQL reads a trigger's WHEN from the catalog's node text, and plans it, once for every
-- statement that fires the trigger: a claim or an outcome batch of 100 jobs read the 20 kB of
-- node text of the nine triggers on UPDATE OF state, as much per statement as a quarter of what
-- the rows themselves cost to write. Each WHEN now keeps what excludes the writes that need
-- nothing (claims, outcomes and releases of jobs without a key or a workflow; a keyed job's
-- claim; a workflow job's claim, release, cancellation and restoration), with lists as one array
-- constant, and about half as much text is read per statement. What the longer WHEN tested
-- besides is tested first thing by the function, for the rows that now call it to no effect:
--  - jobs_revoked_stays_stopped: any revoked row (revoke_queued acts only on the states the
--    WHEN named: it has always tested them itself): a revoked running job that finishes, a
--    revocation written again;
--  - jobs_workflow_completing: a job already finished written completed again (or, may_fail,
--    failed or cancelled again);
--  - jobs_workflow_finished: a may_fail job failing or cancelled (it returns at once, before it
--    bounds the transaction's lock waits);
--  - jobs_unkeyed_requeued: a job without a key written available or retryable while it was;
--  - jobs_key_changed: a keyed job written by a statement that names one of its columns and
--    changes none (a release that leaves a keyed job pending, a fenced progress write of a keyed
--    running job, a revocation written again).
-- jobs_workflow_retried and jobs_workflow_pending keep their tests whole, with lists as constants.
-- A trigger an operator disabled (or enabled for replicas only, or always) stays so: CREATE OR
-- REPLACE TRIGGER would enable it.
--
-- Safe to apply while workers of earlier releases run: one transaction that replaces functions
-- and the triggers of leash.jobs (a catalog change under a brief lock of leash.jobs and of
-- nothing else, as 030), and every row gets the triggers' effect it had before: each function
-- does nothing for a row the WHEN it replaces skipped.

-- Each trigger's enabled state before it is replaced, for this transaction (no temporary table:
-- the migrating role may not have the right to create one).
SELECT pg_catalog.set_config('leash.triggers_enabled_031', coalesce(pg_catalog.jsonb_object_agg(t.tgname, t.tgenabled)::text, '{}'), true)
FROM pg_catalog.pg_trigger t
WHERE t.tgrelid = 'leash.jobs'::regclass AND t.tgname IN ('jobs_workflow_completing', 'jobs_workflow_finished',
    'jobs_workflow_retried', 'jobs_workflow_pending', 'jobs_revoked_stays_stopped', 'jobs_unkeyed_requeued', 'jobs_key_changed');

CREATE OR REPLACE FUNCTION leash.workflow_job_completing() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF OLD.state IN ('completed', 'failed', 'cancelled') THEN
        RETURN NEW;
    END IF;
    INSERT INTO leash.workflow_completed (job_id, workflow_id, step) VALUES (NEW.id, NEW.workflow_id, NEW.step);
    PERFORM set_config('leash.workflow_completed', 'on', true);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER jobs_workflow_completing
    BEFORE UPDATE OF state, revoked_at ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND NEW.state OPERATOR(pg_catalog.=) ANY ('{completed,failed,cancelled}'::text[])
          AND (NEW.state OPERATOR(pg_catalog.=) 'completed' OR NEW.may_fail))
    EXECUTE FUNCTION leash.workflow_job_completing();

-- As in 021, and: a job that may fail, failed or cancelled, is not one of its cases (its
-- dependents are released by leash.workflow_job_completing), and returns before anything.
CREATE OR REPLACE FUNCTION leash.workflow_job_finished() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $$
DECLARE
    r    record;
    prev text;
BEGIN
    IF NEW.state = 'completed' OR (coalesce(NEW.may_fail, false) AND NEW.state IN ('failed', 'cancelled')) THEN
        RETURN NULL;
    END IF;
    prev := leash.bound_outcome_lock_wait();
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

CREATE OR REPLACE TRIGGER jobs_workflow_finished
    AFTER UPDATE OF state, revoked_at ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND NEW.state OPERATOR(pg_catalog.<>) 'completed'
          AND (OLD.state OPERATOR(pg_catalog.=) ANY ('{completed,failed,cancelled}'::text[]))
              OPERATOR(pg_catalog.<>) (NEW.state OPERATOR(pg_catalog.=) ANY ('{completed,failed,cancelled}'::text[])))
    EXECUTE FUNCTION leash.workflow_job_finished();

CREATE OR REPLACE TRIGGER jobs_workflow_retried
    BEFORE UPDATE OF state ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND OLD.state OPERATOR(pg_catalog.=) ANY ('{failed,cancelled}'::text[])
          AND NEW.state OPERATOR(pg_catalog.=) ANY ('{available,retryable}'::text[]))
    EXECUTE FUNCTION leash.workflow_job_retried();

CREATE OR REPLACE TRIGGER jobs_workflow_pending
    BEFORE UPDATE OF state ON leash.jobs
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'pending'
          AND NEW.state OPERATOR(pg_catalog.=) ANY ('{available,retryable,running}'::text[])
          AND pg_catalog.pg_trigger_depth() OPERATOR(pg_catalog.=) 0)
    EXECUTE FUNCTION leash.workflow_pending_written();

CREATE OR REPLACE TRIGGER jobs_revoked_stays_stopped
    BEFORE INSERT OR UPDATE OF state, revoked_at ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.revoked_at IS NOT NULL)
    EXECUTE FUNCTION leash.revoke_queued();

-- As in 029, and: a job queued again by an UPDATE that did not change its state returns at once.
CREATE OR REPLACE FUNCTION leash.wake_unkeyed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state = NEW.state THEN
        RETURN NULL;
    END IF;
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

CREATE OR REPLACE TRIGGER jobs_unkeyed_requeued AFTER UPDATE OF state ON leash.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NULL
        AND NEW.state OPERATOR(pg_catalog.=) ANY ('{available,retryable}'::text[])
        AND pg_catalog.pg_sequence_last_value('leash.keyed_queues'::regclass) OPERATOR(pg_catalog.>) 0)
    EXECUTE FUNCTION leash.wake_unkeyed();

-- As in 029, and: an UPDATE that changed none of the columns the trigger names returns at once.
CREATE OR REPLACE FUNCTION leash.wake_concurrency_keys() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       AND (OLD.state, OLD.run_at, OLD.priority, OLD.queue, OLD.concurrency_key, OLD.attempted_at, OLD.revoked_at)
           IS NOT DISTINCT FROM (NEW.state, NEW.run_at, NEW.priority, NEW.queue, NEW.concurrency_key, NEW.attempted_at, NEW.revoked_at) THEN
        RETURN NULL;
    END IF;
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

CREATE OR REPLACE TRIGGER jobs_key_changed
    AFTER UPDATE OF state, run_at, priority, queue, concurrency_key, attempted_at, revoked_at ON leash.jobs
    FOR EACH ROW WHEN ((OLD.concurrency_key IS NOT NULL OR NEW.concurrency_key IS NOT NULL)
        AND NOT (NEW.state OPERATOR(pg_catalog.=) 'running'
                 AND OLD.state OPERATOR(pg_catalog.=) ANY ('{available,retryable}'::text[])
                 AND OLD.queue OPERATOR(pg_catalog.=) NEW.queue
                 AND OLD.concurrency_key IS NOT DISTINCT FROM NEW.concurrency_key))
    EXECUTE FUNCTION leash.wake_concurrency_keys();

-- Each replaced trigger as the operator had it.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT e.key AS tgname, e.value AS tgenabled
             FROM jsonb_each_text(current_setting('leash.triggers_enabled_031')::jsonb) e WHERE e.value <> 'O' LOOP
        EXECUTE format('ALTER TABLE leash.jobs %s TRIGGER %I',
            CASE r.tgenabled WHEN 'D' THEN 'DISABLE' WHEN 'R' THEN 'ENABLE REPLICA' ELSE 'ENABLE ALWAYS' END, r.tgname);
    END LOOP;
END;
$$;
