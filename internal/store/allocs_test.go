package store_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// allocations is how many heap allocations f made.
func allocations(f func()) float64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return float64(after.Mallocs - before.Mallocs)
}

// A claim and an outcome batch allocate per row only what the row hands on (the claimed job's
// payload), not per column scanned or per array element sent: on a burn-down they run once per
// job, and the allocations are most of the worker's cost per job.
//
// Not parallel: allocations are counted process-wide.
func TestClaimAndFinishAllocationsPerRow(t *testing.T) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const rows = 100
	// Ids and tokens as a table in production has them: pgx boxes an int64 array element in an
	// interface that allocates only for values above 255.
	if _, err := conn.Exec(ctx, `SELECT setval(pg_get_serial_sequence('leash.jobs', 'id'), 1000000000), setval('leash.lease_tokens', 1000000000)`); err != nil {
		t.Fatal(err)
	}
	ps := make([]store.InsertParams, 3*rows)
	for i := range ps {
		ps[i] = jp(store.InsertParams{Kind: "k", Queue: "allocs"})
	}
	if _, err := store.InsertMany(ctx, conn, ps); err != nil {
		t.Fatal(err)
	}
	params := store.ClaimParams{Queues: []string{"allocs"}, Limit: rows, WorkerID: "w", Lease: time.Minute}
	var jobs []store.ClaimedJob
	claim := func() {
		if jobs, err = store.Claim(ctx, conn, params); err != nil || len(jobs) != rows {
			t.Fatalf("claim: %d jobs, %v", len(jobs), err)
		}
	}
	finish := func() {
		outs := make([]store.Outcome, len(jobs))
		for i, j := range jobs {
			outs[i] = store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted}
		}
		if ws, err := store.Finish(ctx, conn, outs); err != nil || len(ws) != rows {
			t.Fatalf("finish: %d written, %v", len(ws), err)
		}
	}
	// The first round prepares the statements.
	if err := store.EnsureQueues(ctx, conn, params.Queues); err != nil {
		t.Fatal(err)
	}
	claim()
	finish()
	// The check of outcomes a batch did not write (their rows were locked, or the leases lost).
	stillHeld := func() {
		ids, tokens := make([]int64, len(jobs)), make([]int64, len(jobs))
		for i, j := range jobs {
			ids[i], tokens[i] = j.ID, j.Token
		}
		if held, err := store.StillHeld(ctx, conn, ids, tokens); err != nil || len(held) != rows {
			t.Fatalf("still held: %d, %v", len(held), err)
		}
	}
	claim()
	stillHeld()
	heldAllocs := allocations(stillHeld) / rows
	finish()
	claimAllocs := allocations(claim) / rows
	finishAllocs := allocations(finish) / rows
	t.Logf("allocations per row: claim %.2f, finish %.2f, still-held check %.2f", claimAllocs, finishAllocs, heldAllocs)
	if heldAllocs > 1.5 {
		t.Errorf("the still-held check allocates %.2f times per row; want at most 1.5 (the ids read back, the map, the statement's share)", heldAllocs)
	}
	// The statement's share: a claim is a pipeline of two statements (its plan settings, then
	// the claim), about 50 allocations for the claim of 100 rows.
	if claimAllocs > 1.6 {
		t.Errorf("a claim allocates %.2f times per row; want at most 1.6 (the payload, and the statement's share)", claimAllocs)
	}
	if finishAllocs > 1 {
		t.Errorf("an outcome batch allocates %.2f times per row; want at most 1 (the statement's share)", finishAllocs)
	}
}
