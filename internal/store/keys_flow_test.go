package store_test

import (
	"context"
	"os"
	"slices"
	"testing"

	"github.com/leashq/leash/internal/pgtest"
)

// A per-key limit set on a queue (from none) while an outcome of a job with a key is in flight:
// the outcome's trigger saw no limit and woke nothing, the limit's trigger saw the job running; a
// claim between the two commits counts that job a holder. Once the outcome commits, the key's next
// job should be claimed; it is not (a known limit, FAULTS.md "Flow control under attack"): the key
// waits for the next change to one of its jobs, or the limit set again.
func TestKeyedLimitSetBesideOutcome(t *testing.T) {
	t.Parallel()
	if os.Getenv("LEASH_KNOWN_LIMITS") == "" {
		t.Skip("known limit: a key whose holder's outcome was in flight as its queue's first per-key limit was set waits for its next change (LEASH_KNOWN_LIMITS=1 runs it)")
	}
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		// ids 1, 2: key a; 1 running (claimed before the queue had a limit).
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('lq', 'w', 'a'), ('lq', 'w', 'a')`,
		`UPDATE leash.jobs SET state = 'running', attempt = 1, lease_token = 1, leased_by = 'w',
		   lease_expires_at = now() + interval '1 hour', attempted_at = now() WHERE id = 1`)
	outcome, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer outcome.Rollback(ctx)
	if _, err := outcome.Exec(ctx, `UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		lease_token = NULL, lease_expires_at = NULL WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	execAll(t, db, `SELECT leash.set_queue_max_running_per_key('lq', 1)`)
	if got := claimedIDs(claimKeyed(t, db, "lq", 10, false)); len(got) != 0 {
		t.Fatalf("claim beside the running job took %v; want nothing", got)
	}
	if err := outcome.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := claimedIDs(claimKeyed(t, db, "lq", 10, false)); !slices.Equal(got, []int64{2}) {
		t.Errorf("claim once the outcome committed took %v; want job 2", got)
	}
	// The workaround the docs give: the limit set again wakes every key of the queue.
	execAll(t, db, `SELECT leash.set_queue_max_running_per_key('lq', 2)`)
	if got := claimedIDs(claimKeyed(t, db, "lq", 10, false)); !slices.Equal(got, []int64{2}) {
		t.Fatalf("claim once the limit was set again took %v; want job 2", got)
	}
}
