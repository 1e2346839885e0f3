-- leash 030: 025's row triggers on updates of leash.jobs fire only for an UPDATE that names a
-- column their WHEN compares.
--
-- Their WHEN was evaluated for every row of every UPDATE of leash.jobs, renewals and progress
-- writes included, which name none of those columns and so never wake a key. With a column list
-- (UPDATE OF ...), PostgreSQL fires them only for an UPDATE whose SET names one of the columns, or
-- whose BEFORE triggers change one: every change the triggers act on still fires them, since their
-- WHEN compares only those columns.
--
-- Safe to apply while workers of earlier releases run: replacing a trigger is a catalog change
-- under a brief lock of leash.jobs (and of nothing else, so that it cannot deadlock with a
-- claim that holds a queue's row), and the triggers do what they did for every row they act on.

CREATE OR REPLACE TRIGGER jobs_key_changed
    AFTER UPDATE OF state, run_at, priority, queue, concurrency_key, attempted_at, revoked_at ON leash.jobs
    FOR EACH ROW WHEN ((OLD.concurrency_key IS NOT NULL OR NEW.concurrency_key IS NOT NULL)
        AND NOT (OLD.state IN ('available', 'retryable') AND NEW.state = 'running'
                 AND OLD.queue = NEW.queue AND OLD.concurrency_key IS NOT DISTINCT FROM NEW.concurrency_key)
        AND (OLD.state, OLD.run_at, OLD.priority, OLD.queue, OLD.concurrency_key, OLD.attempted_at, OLD.revoked_at)
            IS DISTINCT FROM (NEW.state, NEW.run_at, NEW.priority, NEW.queue, NEW.concurrency_key, NEW.attempted_at, NEW.revoked_at))
    EXECUTE FUNCTION leash.wake_concurrency_keys();

CREATE OR REPLACE TRIGGER jobs_unkeyed_requeued AFTER UPDATE OF state ON leash.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NULL AND NEW.state IN ('available', 'retryable')
        AND OLD.state IS DISTINCT FROM NEW.state
        AND pg_catalog.pg_sequence_last_value('leash.keyed_queues'::regclass) OPERATOR(pg_catalog.>) 0)
    EXECUTE FUNCTION leash.wake_unkeyed();
