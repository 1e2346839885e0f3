-- leash 002: a revoked job never runs again, every notification yields to a full queue, and
-- jobs can carry a timeout.
-- Safe to apply while workers of the previous release run: it adds a nullable column, replaces
-- function bodies with the same signatures and behaviour for their callers, and adds a trigger
-- that only ever turns a revoked job's outcome into cancelled.

-- Per-job time limit for one attempt. NULL: the kind's default on the worker (none unless
-- configured). Checked for new rows only (NOT VALID): every existing row is NULL, and
-- validating would scan the table under an exclusive lock.
ALTER TABLE leash.jobs ADD COLUMN timeout interval;
ALTER TABLE leash.jobs ADD CONSTRAINT jobs_timeout_check
    CHECK (timeout IS NULL OR (timeout >= interval '1 millisecond' AND timeout <= interval '100 days')) NOT VALID;

-- Every notification leash sends is skipped when the server's notification queue is over half
-- full (and a revocation's reason is cut to 200 characters in it, so that no reason, however
-- long, can make the payload too long for pg_notify and fail the revocation), so that a stuck listener anywhere can never make a claim, an outcome, a rescue or a
-- revocation fail at commit. Workers poll and re-check their leases, so a skipped notification
-- only costs latency.
CREATE OR REPLACE FUNCTION leash.notify_available(queue text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT CASE WHEN pg_notification_queue_usage() > 0.5 THEN false
                ELSE (SELECT true FROM pg_notify('job_available', queue)) END
$$;

CREATE OR REPLACE FUNCTION leash.notify_revoked(job_id bigint, token bigint, reason text, takeover boolean DEFAULT false)
RETURNS boolean
LANGUAGE sql AS $$
    SELECT CASE WHEN pg_notification_queue_usage() > 0.5 THEN false
                ELSE (SELECT true FROM pg_notify('job_revoked', CASE WHEN takeover
                    THEN json_build_object('id', job_id, 'token', token, 'reason', left(reason, 200), 'takeover', true)
                    ELSE json_build_object('id', job_id, 'token', token, 'reason', left(reason, 200)) END::text)) END
$$;

-- The revocation rule, enforced for every writer (workers of any release, consoles, scripts):
-- a revoked job is never runnable again, and an attempt of a revoked job that ends in failure
-- ends it cancelled. Only a completion stands against a revocation.
CREATE OR REPLACE FUNCTION leash.revoke_queued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('available', 'retryable')
       OR (NEW.state = 'failed' AND TG_OP = 'UPDATE' AND OLD.state = 'running') THEN
        NEW.state := 'cancelled';
        NEW.finished_at := coalesce(NEW.finished_at, now());
        NEW.lease_token := NULL;
        NEW.leased_by := NULL;
        NEW.lease_expires_at := NULL;
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER jobs_revoke_queued ON leash.jobs;
CREATE TRIGGER jobs_revoked_stays_stopped
    BEFORE INSERT OR UPDATE OF state, revoked_at ON leash.jobs
    FOR EACH ROW
    WHEN (NEW.revoked_at IS NOT NULL AND NEW.state IN ('available', 'retryable', 'failed'))
    EXECUTE FUNCTION leash.revoke_queued();

-- Rows a failing attempt put back in the queue after their revocation, before this migration.
UPDATE leash.jobs SET state = 'cancelled', finished_at = now()
WHERE revoked_at IS NOT NULL AND state IN ('available', 'retryable');

-- The insert trigger reads the queue usage once per statement (unchanged), now through the
-- guarded helper.
CREATE OR REPLACE FUNCTION leash.notify_job_available() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    IF pg_notification_queue_usage() > 0.5 THEN
        RETURN NULL;
    END IF;
    FOR q IN
        SELECT DISTINCT n.queue FROM new_jobs n
        WHERE n.state IN ('available', 'retryable') AND n.run_at <= now()
    LOOP
        PERFORM leash.notify_available(q);
    END LOOP;
    RETURN NULL;
END;
$$;

-- Durable revocation, as before; revoking a job that was revoked while running and has since
-- been put back in the queue by a worker of an earlier release cancels it.
CREATE OR REPLACE FUNCTION leash.revoke_job(job_id bigint, reason text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    st text;
    already timestamptz;
BEGIN
    SELECT state, revoked_at INTO st, already FROM leash.jobs WHERE id = job_id FOR UPDATE;
    IF NOT FOUND OR st IN ('completed', 'failed', 'cancelled') THEN
        RETURN false;
    END IF;
    IF already IS NOT NULL THEN
        IF st IN ('available', 'retryable') THEN
            UPDATE leash.jobs SET state = 'cancelled', finished_at = now() WHERE id = job_id;
        ELSE
            -- Revoked before and still running: remind the holder.
            PERFORM leash.notify_revoked(j.id, j.lease_token, j.revoke_reason)
            FROM leash.jobs j WHERE j.id = job_id;
        END IF;
        RETURN true;
    END IF;
    UPDATE leash.jobs SET revoked_at = now(), revoke_reason = reason WHERE id = job_id;
    RETURN true;
END;
$$;
