-- leash 026: a large workflow inserts without a trigger call per job.
--
-- The insert trigger of 020 ran its function for every job of a workflow. For the common job of
-- a large workflow (no dependencies, not written 'pending', no unmet count, its workflow already
-- checked by this transaction) that function changed nothing: it only read the setting that says
-- the workflow was checked. Its WHEN now reads that setting itself, so such a job costs an
-- expression rather than a call of PL/pgSQL (about a third of inserting 10,000 children). Every
-- other job calls the function as before, which does the same work as before; the first job of a
-- workflow in a transaction always does (the setting names no workflow yet, or another one).
--
-- Safe to apply while workers of earlier releases run: the trigger's effect on every row is the
-- one of 020 (a job it skips is one the function would have left unchanged), and replacing a
-- trigger is a catalog change under a brief lock of leash.jobs.

CREATE OR REPLACE TRIGGER jobs_workflow_insert
    BEFORE INSERT ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL
          AND (NEW.depends_on IS NOT NULL OR NEW.unmet IS NOT NULL
               OR NEW.state OPERATOR(pg_catalog.=) 'pending'
               OR coalesce(pg_catalog.current_setting('leash.workflow_exists', true), '')
                  OPERATOR(pg_catalog.<>) NEW.workflow_id::text))
    EXECUTE FUNCTION leash.workflow_job_written();
