-- leash 005: unique jobs, job output, retrying a finished job, durable schedules.
-- leash:no-transaction
-- It runs outside a transaction because the unique-key indexes are built concurrently, without
-- blocking inserts or claims. Every statement is safe to repeat, so a run cut short is simply
-- run again.
-- Safe to apply while workers of the previous release run: it adds nullable columns (no default,
-- no rewrite), indexes that cover only rows with a unique key, a function and a table those
-- workers never touch. They do not record output or run schedules; jobs they claim keep their
-- unique key until they finish them as usual.

-- At most one job per key among the jobs that are not finished, so that
-- INSERT ... ON CONFLICT DO NOTHING dedupes from any SQL client. NULL: no key.
ALTER TABLE leash.jobs ADD COLUMN IF NOT EXISTS unique_key text;

-- What the handler recorded as the job's result, written with the attempt's outcome under the
-- same fence.
ALTER TABLE leash.jobs ADD COLUMN IF NOT EXISTS output jsonb;

-- Keys are bounded so that every key fits in the index (btree entries are limited to about
-- 2.7 kB); checked for new rows only, as every existing row has none.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'jobs_unique_key_check'
                   AND conrelid = 'leash.jobs'::regclass) THEN
        ALTER TABLE leash.jobs ADD CONSTRAINT jobs_unique_key_check
            CHECK (unique_key IS NULL OR (unique_key <> '' AND octet_length(unique_key) <= 1024)) NOT VALID;
    END IF;
END;
$$;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass('leash.jobs_unique_key_idx') AND NOT indisvalid) THEN
        ALTER INDEX leash.jobs_unique_key_idx RENAME TO jobs_unique_key_idx_invalid;
    END IF;
END;
$$;

DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_unique_key_idx_invalid;

CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_unique_key_idx ON leash.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('available', 'retryable', 'running');

-- Finished jobs by key, for inserts that also dedupe against jobs finished recently.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass('leash.jobs_unique_key_finished_idx') AND NOT indisvalid) THEN
        ALTER INDEX leash.jobs_unique_key_finished_idx RENAME TO jobs_unique_key_finished_idx_invalid;
    END IF;
END;
$$;

DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_unique_key_finished_idx_invalid;

CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_unique_key_finished_idx ON leash.jobs (unique_key, finished_at)
    WHERE unique_key IS NOT NULL AND state IN ('completed', 'failed', 'cancelled');

-- A failed or cancelled job runs once more: available now, with exactly one more attempt allowed
-- (max_attempts = attempt + 1), its revocation (if any) lifted and its output cleared; its error
-- history is kept. False for an unknown job, or one that is
-- queued or running. Fails with unique_violation, naming the key, when another job with the same
-- unique key is not finished.
CREATE OR REPLACE FUNCTION leash.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text;
    k text;
BEGIN
    SELECT unique_key INTO k FROM leash.jobs WHERE id = job_id;
    BEGIN
        UPDATE leash.jobs
        SET state = 'available', run_at = now(), max_attempts = attempt + 1,
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

-- Only roles granted EXECUTE may retry jobs (it runs with the owner's rights).
REVOKE ALL ON FUNCTION leash.retry_job(bigint) FROM PUBLIC;

-- Durable periodic jobs. A row inserted with name, spec and kind (and payload) is valid and
-- fires from the next tick on. Whichever worker first sees a tick due enqueues it, in one
-- transaction with advancing next_run_at, so each tick is enqueued exactly once, with no leader.
CREATE TABLE IF NOT EXISTS leash.schedules (
    name         text        PRIMARY KEY,
    -- A 5-field cron expression, optionally after CRON_TZ=<zone>; a descriptor (@hourly, @daily,
    -- @weekly, @monthly, @yearly); or @every <duration> (Go syntax, at least 100ms).
    spec         text        NOT NULL,
    kind         text        NOT NULL,
    payload      jsonb       NOT NULL DEFAULT '{}',
    queue        text        NOT NULL DEFAULT 'default',
    priority     smallint    NOT NULL DEFAULT 0,
    max_attempts integer     NOT NULL DEFAULT 20,
    timeout      interval,
    -- The next tick to enqueue. NULL: the first worker to see the row sets it to the next tick
    -- from then. 'infinity' while the spec cannot be used (see last_error).
    next_run_at  timestamptz,
    last_run_at  timestamptz, -- the last tick enqueued
    last_job_id  bigint,      -- the job enqueued for it
    last_error   text,        -- why the spec could not be used; NULL when it can
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schedules_name_check CHECK (name <> '' AND length(name) <= 128),
    CONSTRAINT schedules_kind_check CHECK (kind <> '' AND length(kind) <= 128),
    CONSTRAINT schedules_queue_check CHECK (queue <> '' AND length(queue) <= 128),
    CONSTRAINT schedules_attempts_check CHECK (max_attempts > 0),
    CONSTRAINT schedules_timeout_check
        CHECK (timeout IS NULL OR (timeout >= interval '1 millisecond' AND timeout <= interval '100 days')),
    -- The shape of a spec; workers check the rest (field ranges, zone names) and record what
    -- they reject in last_error.
    CONSTRAINT schedules_spec_check CHECK (length(spec) <= 256 AND (
        spec ~ '^(CRON_TZ=[^[:space:]]+ +)?([^[:space:]]+[[:space:]]+){4}[^[:space:]]+$'
        OR spec ~ '^(CRON_TZ=[^[:space:]]+ +)?@(yearly|annually|monthly|weekly|daily|midnight|hourly)$'
        OR spec ~ '^@every[[:space:]]+[0-9][0-9a-z.]*$'))
);

CREATE INDEX IF NOT EXISTS schedules_next_run_idx ON leash.schedules (next_run_at);

GRANT SELECT ON leash.schedules TO PUBLIC;

-- A changed spec takes effect from its own next tick, and clears the error of the old one.
CREATE OR REPLACE FUNCTION leash.schedule_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.spec IS DISTINCT FROM OLD.spec THEN
        NEW.next_run_at := NULL;
        NEW.last_error := NULL;
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS schedules_spec_changed ON leash.schedules;

CREATE TRIGGER schedules_spec_changed BEFORE UPDATE ON leash.schedules
    FOR EACH ROW EXECUTE FUNCTION leash.schedule_changed();
