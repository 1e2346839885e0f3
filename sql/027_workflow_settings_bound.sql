-- leash 027: the settings by which a transaction remembers what it checked of a workflow mean
-- that only in the transaction that wrote them, and only until it writes that workflow again.
--
-- Locked workflow. The insert trigger locks a workflow's row FOR KEY SHARE once per transaction
-- (021) and records so in leash.workflow_exists, which the trigger's WHEN reads to skip its
-- function (026). The setting named the workflow alone: a value the session held from before
-- the transaction (a plain SET, ALTER ROLE ... SET, PGOPTIONS, a pooler handing one server
-- session to many clients) skipped the lock and the check that the workflow exists in every
-- later transaction: its jobs went into a workflow that did not exist, or beside a DELETE of an
-- empty one, and both committed (a job of no workflow). The setting now also names the
-- transaction (its id), so no value from outside it matches. The skip stays as cheap: 10,000
-- jobs copied into a workflow took 145 ms with 026's WHEN and with this one.
--
-- Checked graph. A workflow's graph was checked once per transaction (leash.workflows_checked):
-- a transaction that applied its deferred checks early (SET CONSTRAINTS ALL IMMEDIATE) and then
-- inserted jobs with dependencies, or gave a job more, committed them unchecked (a cycle of jobs
-- pending forever). Every write that adds a dependency now takes its workflow off that list, so
-- the commit checks it again.
--
-- Safe to apply while workers of the previous release run: one function and one trigger are
-- replaced, in one transaction, under a brief lock of leash.jobs. A transaction that began under
-- the previous function holds a setting without its id: the new WHEN does not match it, and the
-- new function locks the workflow again (a lock it holds already), which changes nothing.

CREATE OR REPLACE FUNCTION leash.workflow_job_written() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    added   text[];
    checked text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.unmet := NULL; -- counted here and at the commit, never taken from the writer
        IF NEW.workflow_id IS NULL THEN
            RETURN NEW; -- jobs_workflow_check refuses steps and dependencies without a workflow
        END IF;
        -- The row is locked once per transaction and workflow. The setting names the workflow
        -- and the transaction, so that a value set before it (for the session) never matches;
        -- a rolled back savepoint takes back both the lock and the setting.
        IF current_setting('leash.workflow_exists', true) IS DISTINCT FROM
           NEW.workflow_id::text || ':' || pg_current_xact_id()::text THEN
            PERFORM FROM leash.workflows w WHERE w.id = NEW.workflow_id FOR KEY SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'workflow % does not exist', NEW.workflow_id USING ERRCODE = 'foreign_key_violation';
            END IF;
            PERFORM set_config('leash.workflow_exists', NEW.workflow_id::text || ':' || pg_current_xact_id()::text, true);
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
    -- The graph changes: the commit checks it again even if this transaction checked it before
    -- (SET CONSTRAINTS ALL IMMEDIATE), see leash.check_workflow_job.
    checked := current_setting('leash.workflows_checked', true);
    IF position(',' || NEW.workflow_id || ',' IN coalesce(checked, '')) > 0 THEN
        PERFORM set_config('leash.workflows_checked', replace(checked, ',' || NEW.workflow_id || ',', ','), true);
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

-- As in 026, with the setting naming the transaction too (see leash.workflow_job_written).
CREATE OR REPLACE TRIGGER jobs_workflow_insert
    BEFORE INSERT ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL
          AND (NEW.depends_on IS NOT NULL OR NEW.unmet IS NOT NULL
               OR NEW.state OPERATOR(pg_catalog.=) 'pending'
               OR coalesce(pg_catalog.current_setting('leash.workflow_exists', true), '')
                  OPERATOR(pg_catalog.<>)
                  (NEW.workflow_id::text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) pg_catalog.pg_current_xact_id()::text)))
    EXECUTE FUNCTION leash.workflow_job_written();
