package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
)

// A per-key limit set on a queue (from none) while an outcome of a job with a key is in flight:
// the outcome's trigger saw no limit and woke nothing, the limit's trigger saw the job running; a
// claim between the two commits counts that job a holder. Once the outcome commits, the key's next
// job is claimed: once every transaction in flight as the limit committed has ended, the claims
// look at every key of the queue again (migration 029, leash.key_sweeps).
func TestKeyedLimitSetBesideOutcome(t *testing.T) {
	t.Parallel()
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
	// The outcome's triggers ran before the queue had a limit, so they woke no key: the claims
	// see its job still running, and keep looking at the key while that transaction lasts.
	for i := range 3 {
		if got := claimedIDs(claimKeyed(t, db, "lq", 10, false)); len(got) != 0 {
			t.Fatalf("claim %d beside the running job took %v; want nothing", i, got)
		}
	}
	if err := outcome.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The claims look at every key again once no transaction that began before the limit is
	// running (in this cluster: other tests' transactions may delay it a little).
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := claimedIDs(claimKeyed(t, db, "lq", 10, false))
		if slices.Equal(got, []int64{2}) {
			break
		}
		if len(got) != 0 || time.Now().After(deadline) {
			t.Fatalf("claims once the outcome committed took %v; want job 2", got)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Nothing is left to look at: the key's row is at its holder, job 2, and no wake remains.
	var wakes int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes WHERE queue = 'lq' AND key <> ''`).Scan(&wakes); err != nil {
		t.Fatal(err)
	}
	if wakes != 0 {
		t.Errorf("%d wakes of key a left once its holder's outcome committed; want none", wakes)
	}
}
