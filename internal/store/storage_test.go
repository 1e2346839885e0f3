package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Renewals of leases claimed together stay heap-only (HOT) updates: leash.jobs keeps room on each
// page (fillfactor, migration 022) for the claim's new row versions and the renewals' after them.
// A renewal that finds no room on its row's page writes its row elsewhere and two index entries
// (the primary key's and the running jobs'); at fillfactor 80 about half of them did.
// Not parallel: a renewal finds room by pruning the versions the last one left, which a
// transaction of another test on the same server (a database being created) can keep alive, so
// the test runs before the parallel tests of the package start.
func TestRenewalsStayHeapOnly(t *testing.T) {
	db := pgtest.Pool(t)
	ctx := context.Background()
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	c := conn.Conn()
	if _, err := c.Exec(ctx, `ALTER TABLE leash.jobs SET (autovacuum_enabled = off)`); err != nil {
		t.Fatal(err)
	}
	if err := store.EnsureQueues(ctx, c, []string{"default"}); err != nil {
		t.Fatal(err)
	}
	const n = 2000
	ps := make([]store.InsertParams, n)
	for i := range ps {
		ps[i] = store.InsertParams{Queue: "default", Kind: "noop", MaxAttempts: 20}
	}
	if _, err := store.InsertMany(ctx, c, ps); err != nil {
		t.Fatal(err)
	}
	jobs, err := store.Claim(ctx, c, store.ClaimParams{Queues: []string{"default"}, Limit: n, WorkerID: "renewals-worker", Lease: time.Minute})
	if err != nil || len(jobs) != n {
		t.Fatalf("claimed %d of %d: %v", len(jobs), n, err)
	}
	ids, tokens := make([]int64, n), make([]int64, n)
	for i, j := range jobs {
		ids[i], tokens[i] = j.ID, j.Token
	}
	counts := func() (upd, hot int64) {
		t.Helper()
		// This backend's counts, flushed now rather than at its next idle second.
		if _, err := c.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'leash.jobs'::regclass`).Scan(&upd, &hot); err != nil {
			t.Fatal(err)
		}
		return upd, hot
	}
	upd0, hot0 := counts()
	const renewals = 3
	for range renewals {
		got, err := store.Renew(ctx, c, store.RenewParams{IDs: ids, Tokens: tokens, Lease: time.Minute})
		if err != nil || len(got) != n {
			t.Fatalf("renewed %d of %d: %v", len(got), n, err)
		}
	}
	upd, hot := counts()
	upd, hot = upd-upd0, hot-hot0
	if upd != renewals*n {
		t.Fatalf("%d updates counted for %d renewals of %d leases", upd, renewals, n)
	}
	if share := float64(hot) / float64(upd); share < 0.75 {
		t.Fatalf("%d of %d renewals (%.0f%%) were heap-only updates, want at least 75%%", hot, upd, 100*share)
	}
	t.Logf("%d of %d renewals heap-only", hot, upd)
}
