package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func execAll(t *testing.T, db *pgxpool.Pool, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		if _, err := db.Exec(context.Background(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}

func claimKeyed(t *testing.T, db *pgxpool.Pool, queue string, limit int, unkeyed bool) []store.ClaimedJob {
	t.Helper()
	jobs, err := store.ClaimKeyed(context.Background(), db, store.KeyedParams{Unkeyed: unkeyed,
		ClaimParams: store.ClaimParams{Queues: []string{queue}, Limit: limit, WorkerID: "w", Lease: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	return jobs
}

func claimedIDs(jobs []store.ClaimedJob) []int64 {
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	slices.Sort(ids)
	return ids
}

// A key's jobs start one after the other in its (priority, run_at, id) order with a per-key limit
// of 1; a job that waits to run again (a retry) holds its key, and runs before the key's next
// job; jobs without a key are not limited by the keys.
func TestClaimKeyedSequential(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		// ids 1..6: a a b b (b's second at priority -1, so first in b's order), then two without a key.
		`INSERT INTO leash.jobs (queue, kind, concurrency_key, priority) VALUES
		   ('kq', 'k', 'a', 0), ('kq', 'k', 'a', 0), ('kq', 'k', 'b', 0), ('kq', 'k', 'b', -1),
		   ('kq', 'k', NULL, 0), ('kq', 'k', NULL, 0)`)
	got := claimedIDs(claimKeyed(t, db, "kq", 10, true))
	if want := []int64{1, 4, 5, 6}; !slices.Equal(got, want) {
		t.Fatalf("first claim took %v; want %v", got, want)
	}
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 0 {
		t.Fatalf("second claim took %v; want nothing (each key is held)", claimedIDs(got))
	}
	// Job 1 fails and waits to retry: it holds a, so job 2 does not start.
	execAll(t, db, `UPDATE leash.jobs SET state = 'retryable', run_at = now() + interval '1 hour',
		lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id = 1`)
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 0 {
		t.Fatalf("claim took %v while job 1 waits to retry; want nothing", claimedIDs(got))
	}
	// Due again: job 1 runs again, before job 2.
	execAll(t, db, `UPDATE leash.jobs SET run_at = now() WHERE id = 1`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, true)); !slices.Equal(got, []int64{1}) {
		t.Fatalf("claim took %v; want job 1 again", got)
	}
	// Job 1 and job 4 complete: 2 and 3 start.
	execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id IN (1, 4)`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, true)); !slices.Equal(got, []int64{2, 3}) {
		t.Fatalf("claim took %v; want 2 and 3", got)
	}
	var rows, wakes int
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM leash.concurrency_keys), (SELECT count(*) FROM leash.key_wakes)`).Scan(&rows, &wakes); err != nil {
		t.Fatal(err)
	}
	if rows != 0 || wakes != 0 {
		t.Fatalf("%d key rows and %d wakes left; want none (nothing left to claim)", rows, wakes)
	}
}
