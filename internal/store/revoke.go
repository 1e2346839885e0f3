package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/clean"
)

// Revocation is a revocation that arrived as a notification for a claim this worker holds (or
// just held), to record in the job's row.
type Revocation struct {
	ID      int64
	Token   int64 // the claim
	Attempt int32 // the claim's attempt
	Reason  string
	// Job is true for a revocation of the job (a bare id, as typed in psql): if the claim has
	// just ended with the job back in the queue, and nobody has claimed it since, the queued job
	// is revoked (and so cancelled). False for a revocation of that claim only.
	Job bool
}

// MarkRevoked records revocations: revoked_at and the reason, on every job still held by the
// revocation's claim, or, for a revocation of the job, put back in the queue by that claim's
// outcome since (the database's revocation rule then cancels it). It never waits on a row lock:
// it returns the ids whose row was locked by another transaction, to try again later; every
// other revocation is settled (written, or no longer applicable).
func MarkRevoked(ctx context.Context, db DBTX, rs []Revocation) (locked []int64, err error) {
	n := len(rs)
	ids, tokens, attempts, reasons, jobs := make([]int64, n), make([]int64, n), make([]int32, n), make([]string, n), make([]bool, n)
	for i, r := range rs {
		ids[i], tokens[i], attempts[i], reasons[i], jobs[i] = r.ID, r.Token, r.Attempt, clean.Text(r.Reason, MaxReasonBytes), r.Job
	}
	rows, err := db.Query(ctx, `
		WITH wanted AS (
			SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::text[], $5::boolean[])
				AS u(id, token, attempt, reason, job)
		), applicable AS (
			SELECT j.id, w.reason FROM leash.jobs j JOIN wanted w ON j.id = w.id
			WHERE j.revoked_at IS NULL AND (
			    (j.state = 'running' AND j.lease_token = w.token)
			    -- Put back in the queue by this claim's outcome (a retry keeps the attempt, a
			    -- hand-back gives it back), and not claimed since.
			 OR (w.job AND j.state IN ('available', 'retryable') AND j.attempt IN (w.attempt, w.attempt - 1)))
		), target AS (
			-- The conditions again, here: a row that changed since this statement's snapshot (a
			-- rescue made it failed, an outcome wrote it) is checked again once locked.
			SELECT j.id, w.reason FROM leash.jobs j JOIN wanted w ON j.id = w.id
			WHERE j.revoked_at IS NULL AND (
			    (j.state = 'running' AND j.lease_token = w.token)
			 OR (w.job AND j.state IN ('available', 'retryable') AND j.attempt IN (w.attempt, w.attempt - 1)))
			ORDER BY j.id
			FOR NO KEY UPDATE OF j SKIP LOCKED
		), done AS (
			UPDATE leash.jobs j SET revoked_at = now(), revoke_reason = t.reason
			FROM target t WHERE j.id = t.id
			RETURNING j.id
		)
		SELECT id FROM applicable WHERE id NOT IN (SELECT id FROM done)`, ids, tokens, attempts, reasons, jobs)
	if err != nil {
		return nil, fmt.Errorf("record revocations: %w", err)
	}
	locked, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("record revocations: %w", err)
	}
	return locked, nil
}

// Revoke calls leash.revoke_job.
func Revoke(ctx context.Context, db DBTX, id int64, reason string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT leash.revoke_job($1, nullif($2, ''))`, id, clean.Text(reason, MaxReasonBytes)).Scan(&ok); err != nil {
		return false, fmt.Errorf("revoke job %d: %w", id, err)
	}
	return ok, nil
}

// RetryJob makes a failed or cancelled job run once more (leash.retry_job): false for an unknown,
// queued or running job. It fails with a unique violation when another unfinished job holds the
// job's unique key.
func RetryJob(ctx context.Context, db DBTX, id int64) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT leash.retry_job($1)`, id).Scan(&ok); err != nil {
		return false, fmt.Errorf("retry job %d: %w", id, err)
	}
	return ok, nil
}
