package store

import (
	"context"
	"fmt"
	"time"
)

// claimByIDSQL leases one queued job, named by id, as a claim would ($2: 1, the limit).
var claimByIDSQL = fmt.Sprintf(`
	WITH picked AS (
		SELECT ctid, id FROM leash.jobs
		WHERE id = $1 AND state IN ('available', 'retryable')
		LIMIT $2
		FOR UPDATE
	)`+claimTail, claimTraceContextBytes)

// ClaimByID leases the queued job id for worker, as a claim of its queue would, whatever its
// queue, run_at or the queue's limits: the test helper (pool/pooltest) runs one job so. It
// fails when the job is not queued.
func ClaimByID(ctx context.Context, db DBTX, id int64, worker string, lease time.Duration) (ClaimedJob, error) {
	rows, err := db.Query(ctx, claimByIDSQL, id, 1, worker, millis(lease))
	if err != nil {
		return ClaimedJob{}, fmt.Errorf("claim job %d: %w", id, err)
	}
	jobs, err := scanClaimed(rows, 1)
	switch {
	case err != nil:
		return ClaimedJob{}, err
	case len(jobs) == 0:
		return ClaimedJob{}, fmt.Errorf("claim job %d: not queued", id)
	case jobs[0].SetAside:
		return ClaimedJob{}, fmt.Errorf("claim job %d: set aside, its attempt counter is at its limit", id)
	}
	return jobs[0], nil
}
