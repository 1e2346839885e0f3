-- leash 015: retry_job gives a job whose attempt counter has no room left (a row the claim set
-- aside at 2147483647 attempts, written so by some SQL client) its one more run by starting its
-- count again, rather than failing with "integer out of range" on attempt + 1: that is the row an
-- operator retries first. Every other job is retried as before (one more attempt allowed).
-- Safe to apply while workers of the previous release run: it replaces one function's body, with
-- the same signature, rights and grants.

CREATE OR REPLACE FUNCTION leash.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text;
    k text;
BEGIN
    SELECT unique_key INTO k FROM leash.jobs WHERE id = job_id;
    BEGIN
        UPDATE leash.jobs
        SET state = 'available', run_at = now(),
            -- No room for another claim (the claim adds one): the count starts again, with one
            -- attempt allowed.
            attempt = CASE WHEN attempt >= 2147483646 THEN 0 ELSE attempt END,
            max_attempts = CASE WHEN attempt >= 2147483646 THEN 1 ELSE attempt + 1 END,
            finished_at = NULL, revoked_at = NULL, revoke_reason = NULL, output = NULL
        WHERE id = job_id AND state IN ('failed', 'cancelled')
        RETURNING queue INTO q;
    EXCEPTION WHEN unique_violation THEN
        RAISE unique_violation USING MESSAGE = format(
            'job %s cannot run again: another job with unique key %s is not finished', job_id, left(k, 200));
    END;
    IF q IS NULL THEN
        RETURN false;
    END IF;
    PERFORM leash.notify_available(q);
    RETURN true;
END;
$$;
