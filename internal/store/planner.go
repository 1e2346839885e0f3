package store

import (
	"context"
	"fmt"
)

// RefreshJobsStats analyzes leash.jobs when it has grown to more than twice the size its
// planner statistics record (and to at least 1 MB), and reports whether it did. Prepared
// statements keep a generic plan made for the table's size at the time until the statistics
// change; an outcome batch planned on a small table hashes a scan of the whole table, which a
// queue that grows a hundredfold in a minute would pay on every batch until autovacuum's next
// look. Cheap when the statistics are current; one caller analyzes at a time, and a caller that
// would wait for the table lock (autovacuum at work) returns false. Call it outside a
// transaction: the locks it takes last until the caller's transaction ends. The caller's role
// needs EXECUTE on leash.refresh_jobs_stats() (the migrating role has it).
func RefreshJobsStats(ctx context.Context, db DBTX) (bool, error) {
	var analyzed bool
	if err := db.QueryRow(ctx, `SELECT leash.refresh_jobs_stats()`).Scan(&analyzed); err != nil {
		return false, fmt.Errorf("refresh statistics of leash.jobs: %w", err)
	}
	return analyzed, nil
}
