-- leash 004: queue control. A paused queue is claimed by no worker, starting at once across the
-- fleet; a capped queue (max_running) has at most that many jobs running at once across all
-- workers. A queue without a row in leash.queues is active and uncapped.
-- leash:no-transaction
-- It runs outside a transaction because the index that counts a queue's running jobs replaces
-- the running-jobs index concurrently, without blocking inserts or claims. Every statement is
-- safe to repeat, so a run cut short is simply run again.
-- Safe to apply while workers of the previous release run: it adds a table, functions, a
-- trigger on the new table and swaps an index none of their statements depends on. Those
-- workers do not read leash.queues: pauses and caps bind every worker once all run this release.

CREATE TABLE IF NOT EXISTS leash.queues (
    name        text        PRIMARY KEY,
    -- When the queue was paused; NULL while it is active.
    paused_at   timestamptz,
    -- At most this many of the queue's jobs run at once across all workers; NULL: no cap.
    max_running integer,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queues_name_check CHECK (name <> '' AND length(name) <= 128),
    CONSTRAINT queues_max_running_check CHECK (max_running IS NULL OR max_running >= 0)
);

-- Workers read this table before claiming; whoever inserts jobs need not.
GRANT SELECT ON leash.queues TO PUBLIC;

-- Every change to a queue's row is announced on queue_changed (payload: the queue name), so that
-- workers re-read the row at once. The notification is a hint, never the guarantee: claims check
-- the row themselves, and workers re-read the table at every poll and after every reconnect of
-- their listener. Skipped when the notification queue is over half full, like every other one.
CREATE OR REPLACE FUNCTION leash.notify_queue_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_notification_queue_usage() <= 0.5 THEN
        PERFORM pg_notify('queue_changed', CASE WHEN TG_OP = 'DELETE' THEN OLD.name ELSE NEW.name END);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS queues_changed ON leash.queues;

CREATE TRIGGER queues_changed AFTER INSERT OR UPDATE OR DELETE ON leash.queues
    FOR EACH ROW EXECUTE FUNCTION leash.notify_queue_changed();

-- Pauses a queue: once this returns (and commits), no worker of this release starts a job of the
-- queue; running jobs go on. True when the queue was active, false when it was already paused.
CREATE OR REPLACE FUNCTION leash.pause_queue(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed boolean;
BEGIN
    INSERT INTO leash.queues AS q (name, paused_at) VALUES (pause_queue.name, now())
    ON CONFLICT ON CONSTRAINT queues_pkey DO UPDATE SET paused_at = now(), updated_at = now()
        WHERE q.paused_at IS NULL
    RETURNING true INTO changed;
    RETURN coalesce(changed, false);
END;
$$;

-- Only roles granted EXECUTE may pause a queue (they run with the owner's rights).
REVOKE ALL ON FUNCTION leash.pause_queue(text) FROM PUBLIC;

-- Resumes a paused queue: workers claim from it again at once. True when it was paused.
CREATE OR REPLACE FUNCTION leash.resume_queue(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed boolean;
BEGIN
    UPDATE leash.queues q SET paused_at = NULL, updated_at = now()
    WHERE q.name = resume_queue.name AND q.paused_at IS NOT NULL
    RETURNING true INTO changed;
    RETURN coalesce(changed, false);
END;
$$;

REVOKE ALL ON FUNCTION leash.resume_queue(text) FROM PUBLIC;

-- Running jobs by queue (and worker): a capped queue's claim counts its running jobs here, and
-- the rescuer and status find running jobs. Replaces jobs_running_idx (leased_by alone), so that
-- a claim still maintains the same number of indexes. Neither index is on lease_expires_at or
-- heartbeat_at: renewals stay heap-only updates.
-- A build cut short leaves an invalid index behind: only such a one is dropped and built again,
-- never a valid one (this migration may be run again after a later statement failed).
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass('leash.jobs_running_queue_idx') AND NOT indisvalid) THEN
        ALTER INDEX leash.jobs_running_queue_idx RENAME TO jobs_running_queue_idx_invalid;
    END IF;
END;
$$;

DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_running_queue_idx_invalid;

CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_running_queue_idx ON leash.jobs (queue, leased_by) WHERE state = 'running';

DROP INDEX CONCURRENTLY IF EXISTS leash.jobs_running_idx;
