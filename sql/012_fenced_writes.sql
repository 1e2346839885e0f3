-- leash 012: a fenced transaction keeps its job's lease however long it lasts, and a revocation
-- neither waits for it nor loses to it.
-- job.Fence used to lock the job's row FOR NO KEY UPDATE until the business transaction ended,
-- and job.SetProgressTx and job.CompleteTx updated the row inside it. That lock conflicts with
-- the lease renewal's (which skips locked rows, so a transaction longer than the trust window
-- lost its lease and the job ran again) and with leash.revoke_job's and UPDATE ... SET
-- revoked_at's (which waited for the transaction, and told the handler only once it ended).
-- From this release Fence locks the row FOR KEY SHARE: renewals, revocations and outcome writes
-- (all FOR NO KEY UPDATE) go on beside it, while a takeover (the rescuer's FOR UPDATE SKIP LOCKED)
-- still cannot touch a row its claim's transaction holds. The transaction's own writes to the
-- row are staged in leash.fenced_writes and applied by the deferred trigger below when it
-- commits, under the fence: the commit fails if the claim was revoked or lost in the meantime.
-- A transaction that writes the job's row itself (an UPDATE of leash.jobs, or SET CONSTRAINTS
-- ALL IMMEDIATE, which applies the staged writes at once) holds it FOR NO KEY UPDATE from then on,
-- as before.
-- Safe to apply while workers of the previous release run: it adds a table those workers do not
-- use, and makes leash.revoke_job lock the row FOR NO KEY UPDATE instead of FOR UPDATE, which
-- still conflicts with everything those workers hold the row with (their Fence and CompleteTx,
-- FOR NO KEY UPDATE; their outcomes and renewals, UPDATE) and with every takeover, so that for
-- them a revocation behaves as before: it waits for their fenced transaction.

-- Writes of a fenced transaction to its job's row, applied when that transaction commits. A row
-- is inserted by Fence (a check alone), SetProgressTx (a checkpoint) or CompleteTx (the
-- completion and its output), and deleted again in the same transaction by the trigger that
-- applies it, so that no row of it is ever committed.
CREATE TABLE leash.fenced_writes (
    seq      bigint  GENERATED ALWAYS AS IDENTITY,
    job_id   bigint  NOT NULL,
    token    bigint  NOT NULL,
    -- A checkpoint to store; NULL: none.
    progress jsonb,
    -- Complete the job, with output as its result.
    complete boolean NOT NULL DEFAULT false,
    output   jsonb
);

-- Applies, at the commit of the transaction that staged them, every staged write of one claim
-- (the first of its events applies them all; the others find nothing left), fenced by the claim's
-- token: the job must still run under that token and not be revoked, or the commit fails
-- (SQLSTATE LR001 revoked, LR002 lease gone) and nothing of the transaction is committed.
--
-- Why no revocation can slip past: the statement below takes the row FOR SHARE or updates it
-- (FOR NO KEY UPDATE), and both conflict with the FOR NO KEY UPDATE that leash.revoke_job and
-- UPDATE ... SET revoked_at take. In READ COMMITTED a locking statement that meets a row being
-- changed by a transaction still in progress waits for it and then evaluates its condition
-- again on the row's newest version. So take a revocation R that commits (and so returns
-- true) before this transaction's commit completes:
--   - if R's change was committed before this statement ran, the statement's snapshot, taken
--     when it starts (a new one for each statement of a volatile function), sees revoked_at;
--   - if R was changing the row when this statement came to it, the statement waited for R and
--     found revoked_at on the row's newest version;
--   - otherwise this statement locked the row first, and R waits for the lock, which this
--     transaction holds until its commit has completed: R then ran after the commit, against
--     a row that is completed (revoke_job returns false) or still running under a claim whose
--     effects it follows.
-- In the first two cases the commit fails. The same holds for a takeover (FOR UPDATE) and for
-- an outcome written by another transaction (FOR NO KEY UPDATE): the condition checks the token.
-- It runs with the rights of the committing role, which must be allowed to update leash.jobs,
-- as Fence already requires: a role that may not cannot commit a staged write, nor hold the
-- row through this function (SET CONSTRAINTS ALL IMMEDIATE fails for it the same way).
CREATE FUNCTION leash.apply_fenced_writes() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    staged bigint;
    done boolean;
    last_progress jsonb;
    out jsonb;
    st text;
    tok bigint;
    rev timestamptz;
BEGIN
    -- PostgreSQL stops the statement timer before a commit runs its deferred triggers: the lock
    -- waits below are bounded by lock_timeout alone. A transaction that set neither waits at most
    -- a minute (an operator's open UPDATE of the row), one that set statement_timeout that long.
    IF current_setting('lock_timeout') = '0' THEN
        PERFORM set_config('lock_timeout',
            CASE WHEN current_setting('statement_timeout') <> '0' THEN current_setting('statement_timeout') ELSE '1min' END, true);
    END IF;
    SELECT count(*), coalesce(bool_or(f.complete), false),
           (array_agg(f.progress ORDER BY f.seq DESC) FILTER (WHERE f.progress IS NOT NULL))[1],
           (array_agg(f.output ORDER BY f.seq DESC) FILTER (WHERE f.complete))[1]
      INTO staged, done, last_progress, out
      FROM leash.fenced_writes f WHERE f.job_id = NEW.job_id AND f.token = NEW.token;
    IF staged = 0 THEN
        RETURN NULL; -- applied with an earlier event of this claim
    END IF;
    DELETE FROM leash.fenced_writes f WHERE f.job_id = NEW.job_id AND f.token = NEW.token;
    IF done OR last_progress IS NOT NULL THEN
        UPDATE leash.jobs j
        SET progress = coalesce(last_progress, j.progress),
            state = CASE WHEN done THEN 'completed' ELSE j.state END,
            finished_at = CASE WHEN done THEN now() ELSE j.finished_at END,
            output = CASE WHEN done THEN out ELSE j.output END,
            lease_token = CASE WHEN done THEN NULL ELSE j.lease_token END,
            leased_by = CASE WHEN done THEN NULL ELSE j.leased_by END,
            lease_expires_at = CASE WHEN done THEN NULL ELSE j.lease_expires_at END
        WHERE j.id = NEW.job_id AND j.lease_token = NEW.token AND j.state = 'running' AND j.revoked_at IS NULL;
    ELSE
        PERFORM FROM leash.jobs j
        WHERE j.id = NEW.job_id AND j.lease_token = NEW.token AND j.state = 'running' AND j.revoked_at IS NULL
        FOR SHARE;
    END IF;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT j.state, j.lease_token, j.revoked_at INTO st, tok, rev FROM leash.jobs j WHERE j.id = NEW.job_id;
    IF rev IS NOT NULL AND (tok = NEW.token OR st = 'cancelled') THEN
        RAISE EXCEPTION 'job % was revoked: its fenced transaction cannot commit', NEW.job_id
            USING ERRCODE = 'LR001';
    END IF;
    RAISE EXCEPTION 'job % is no longer held under lease token %: its fenced transaction cannot commit', NEW.job_id, NEW.token
        USING ERRCODE = 'LR002';
END;
$$;

CREATE CONSTRAINT TRIGGER fenced_writes_apply
    AFTER INSERT ON leash.fenced_writes
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION leash.apply_fenced_writes();

-- Only its owner may use it until granted, like every table of schema leash: a worker role of its
-- own (the role whose transactions call Fence, SetProgressTx or CompleteTx) needs
--   GRANT SELECT, INSERT, DELETE ON leash.fenced_writes TO worker;
-- (README, Privileges). Even granted, it gives a role without rights on leash.jobs nothing: it
-- sees no committed row (there are none), its own rows block nobody (no unique index, no foreign
-- key), and it cannot commit them, since applying them updates or locks a row of leash.jobs with
-- its own rights.
REVOKE ALL ON leash.fenced_writes FROM PUBLIC;

-- Durable revocation, as before, without waiting for a fenced transaction of the job: the row is
-- locked FOR NO KEY UPDATE, which Fence's FOR KEY SHARE allows. The revocation commits at once,
-- its notification reaches the holder at once, and the fenced transaction's commit then fails
-- (see leash.apply_fenced_writes). It still waits for a transaction that writes the row (an
-- operator's UPDATE or SELECT ... FOR UPDATE, a worker of an earlier release inside Fence).
CREATE OR REPLACE FUNCTION leash.revoke_job(job_id bigint, reason text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    st text;
    already timestamptz;
BEGIN
    SELECT state, revoked_at INTO st, already FROM leash.jobs WHERE id = job_id FOR NO KEY UPDATE;
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
