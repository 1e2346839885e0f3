package store

import (
	"context"
	"fmt"
	"time"
)

// DeleteFinished deletes up to batch jobs that finished (completed when completed is true; failed
// or cancelled otherwise) more than olderThan ago, oldest first, skipping rows locked by another
// deleter, and returns how many it deleted. Each call is one short statement. The jobs of a
// workflow that still has unfinished jobs are kept, however old: its graph needs them (a retry
// of a dependent, a job added by a fan-out, checks its dependencies by name).
func DeleteFinished(ctx context.Context, db DBTX, completed bool, olderThan time.Duration, batch int) (int64, error) {
	states := `state IN ('failed', 'cancelled')`
	if completed {
		states = `state = 'completed'`
	}
	tag, err := db.Exec(ctx, `
		DELETE FROM leash.jobs WHERE id IN (
			SELECT id FROM leash.jobs
			WHERE `+states+` AND finished_at < now() - $1 * interval '1 millisecond'
			  AND (workflow_id IS NULL OR NOT EXISTS (
			      SELECT FROM leash.jobs u WHERE u.workflow_id = leash.jobs.workflow_id
			        AND u.state IN ('pending', 'available', 'running', 'retryable')))
			ORDER BY finished_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED)`, millis(olderThan), batch)
	if err != nil {
		return 0, fmt.Errorf("delete finished jobs: %w", err)
	}
	return tag.RowsAffected(), nil
}
