-- leash 007: per-minute figures for the admin page's charts.
-- Safe to apply while workers of the previous release run: it only adds a table, which they never
-- read. It builds no index on leash.jobs.

-- One row per minute, written shortly after the minute ends by whichever worker takes the turn
-- (a transaction-scoped advisory lock; the others skip), and deleted after a day by the same
-- statement's transaction. The rows of leash.jobs alone cannot tell how deep the queue was an hour
-- ago (the jobs waiting then have finished since, and retention deletes them), so the depth is
-- read as it is and kept here; the other columns could be counted again from leash.jobs while its
-- rows last, and are kept so that the page reads sixty small rows instead.
CREATE TABLE IF NOT EXISTS leash.minute_stats (
    -- The minute covered: [minute, minute + 1 minute).
    minute        timestamptz PRIMARY KEY,
    -- Jobs whose finished_at falls in the minute, by final state.
    completed     bigint      NOT NULL,
    failed        bigint      NOT NULL,
    cancelled     bigint      NOT NULL,
    -- Attempts whose attempted_at falls in the minute, among jobs running or finished when the
    -- minute was sampled (a job's row keeps its latest attempt only, and a retried or handed-back
    -- job's run_at no longer tells when that attempt became runnable), and their pickup latency
    -- attempted_at - greatest(run_at, created_at) in milliseconds; NULL when none.
    started       bigint      NOT NULL,
    pickup_p50_ms double precision,
    pickup_p99_ms double precision,
    -- Jobs in state available or retryable when the minute was sampled (sampled_at), and those
    -- of them runnable then (run_at <= sampled_at). NULL for a minute filled in later, when no
    -- worker sampled it in time: a past depth cannot be read from the rows.
    queued        bigint,
    runnable      bigint,
    sampled_at    timestamptz NOT NULL DEFAULT now()
);
