package store

import (
	"context"
	"fmt"
	"time"
)

// DeleteFinished deletes up to batch jobs that finished (completed when completed is true; failed
// or cancelled otherwise) more than olderThan ago, oldest first, skipping rows locked by another
// deleter, and returns how many it deleted. Each call is one short statement.
func DeleteFinished(ctx context.Context, db DBTX, completed bool, olderThan time.Duration, batch int) (int64, error) {
	states := `state IN ('failed', 'cancelled')`
	if completed {
		states = `state = 'completed'`
	}
	tag, err := db.Exec(ctx, `
		DELETE FROM leash.jobs WHERE id IN (
			SELECT id FROM leash.jobs
			WHERE `+states+` AND finished_at < now() - $1 * interval '1 millisecond'
			ORDER BY finished_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED)`, millis(olderThan), batch)
	if err != nil {
		return 0, fmt.Errorf("delete finished jobs: %w", err)
	}
	return tag.RowsAffected(), nil
}
