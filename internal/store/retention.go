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
	tag, err := db.Exec(ctx, deleteFinishedSQL(completed), millis(olderThan), batch)
	if err != nil {
		return 0, fmt.Errorf("delete finished jobs: %w", err)
	}
	return tag.RowsAffected(), nil
}

// deleteFinishedSQL is DeleteFinished's statement ($1 the age in milliseconds, $2 the batch).
// Every plan of it reads indexes only, whatever the table holds and whichever plan the session
// uses:
//   - the rows are picked through jobs_finished_idx and deleted by id through the primary key,
//     as an array (id = ANY): a generic plan estimates LIMIT $2 at a tenth of the table, and the
//     join of IN (...) then hashed a scan of all of it (3 million rows read to delete 1000);
//   - a workflow's unfinished jobs are looked up through jobs_workflow_unfinished_idx, whose
//     predicate the subquery repeats (workflow_id IS NOT NULL): the planner runs the lookup once,
//     hashed, without the outer row, and without the predicate it read the whole table as soon
//     as one job of a workflow was among those to delete.
func deleteFinishedSQL(completed bool) string {
	states := `state IN ('failed', 'cancelled')`
	if completed {
		states = `state = 'completed'`
	}
	return `
		DELETE FROM leash.jobs WHERE id = ANY (ARRAY(
			SELECT id FROM leash.jobs
			WHERE ` + states + ` AND finished_at < now() - $1 * interval '1 millisecond'
			  AND (workflow_id IS NULL OR NOT EXISTS (
			      SELECT FROM leash.jobs u WHERE u.workflow_id = leash.jobs.workflow_id AND u.workflow_id IS NOT NULL
			        AND u.state IN ('pending', 'available', 'running', 'retryable')))
			ORDER BY finished_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED))`
}

// DeleteEmptyWorkflows deletes up to batch workflow rows created more than olderThan ago that
// have no jobs left (retention deleted them once they finished), lowest id first, and returns
// how many it deleted: one short call of leash.delete_empty_workflows. A workflow a transaction
// is inserting a job into is never deleted: the insert holds its row FOR KEY SHARE, which the
// function passes by, and one whose job committed meanwhile is passed by too.
func DeleteEmptyWorkflows(ctx context.Context, db DBTX, olderThan time.Duration, batch int) (int64, error) {
	var n int32
	err := db.QueryRow(ctx, `SELECT leash.delete_empty_workflows($1 * interval '1 millisecond', $2)`,
		millis(olderThan), batch).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("delete empty workflows: %w", err)
	}
	return int64(n), nil
}

// DeleteIdleKeyRates deletes up to batch rows of leash.key_rates (the recorded starts of a key
// under a per-key rate limit) whose starts have all left their queue's window, or whose queue no
// longer has a per-key rate limit, and returns how many: one short call of
// leash.delete_idle_key_rates. A row a claim holds is passed by.
func DeleteIdleKeyRates(ctx context.Context, db DBTX, batch int) (int64, error) {
	var n int32
	if err := db.QueryRow(ctx, `SELECT leash.delete_idle_key_rates($1)`, batch).Scan(&n); err != nil {
		return 0, fmt.Errorf("delete idle key rates: %w", err)
	}
	return int64(n), nil
}
