package pool

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A batch the database rejects is split until the bad outcome is alone: every other outcome in
// it is written, once.
func TestWriteSplitsRejectedBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	p, err := New(db, Config{})
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		if _, err := store.Insert(ctx, db, store.InsertParams{Kind: "k", Queue: QueueDefault, MaxAttempts: MaxAttemptsDefault}); err != nil {
			t.Fatal(err)
		}
	}
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 10 {
		t.Fatalf("claim: %d %v", len(jobs), err)
	}
	items := make([]finishItem, len(jobs))
	for i, j := range jobs {
		items[i] = finishItem{out: store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted}, job: &Job{ID: j.ID, claim: store.ClaimedJob{ID: j.ID, Token: j.Token}}}
	}
	bad := jobs[6].ID
	items[6].out.State = "exploded" // violates jobs_state_check whatever its text
	// The finisher's buffers: the halves a rejection splits the batch into reuse them.
	sc := &finishScratch{}
	written := sc.writtenStates(len(items))
	p.write(items, written, sc)
	if len(written) != 9 {
		t.Fatalf("wrote %d outcomes, want 9: %v", len(written), written)
	}
	if _, ok := written[bad]; ok {
		t.Fatal("the bad outcome was written")
	}
	var completed int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`).Scan(&completed)
	if completed != 9 {
		t.Fatalf("%d completed", completed)
	}
}

// ensureAndClaim creates the queues' rows, as a pool does before it claims, then claims.
func ensureAndClaim(ctx context.Context, db store.DBTX, p store.ClaimParams) ([]store.ClaimedJob, error) {
	if err := store.EnsureQueues(ctx, db, p.Queues); err != nil {
		return nil, err
	}
	return store.Claim(ctx, db.(store.Batcher), p) // a pool, a connection or a transaction
}

// The finisher's buffers keep nothing of a batch once it is written: not the outcomes a split
// batch's last half left past its length, not the buffers of a batch larger than finishBatch.
func TestFinishScratchKeepsNothing(t *testing.T) {
	t.Parallel()
	sc := &finishScratch{}
	outs := sc.outcomes(5)
	for i := range outs {
		outs[i] = store.Outcome{ID: int64(i + 1), Output: []byte(`{}`), Error: &store.AttemptError{Error: "x"}}
	}
	sc.outcomes(1) // the last half of a split batch
	sc.done()
	for i, o := range sc.outs[:cap(sc.outs)] {
		if o.ID != 0 || o.Output != nil || o.Error != nil {
			t.Fatalf("outcome %d kept after the batch: %+v", i, o)
		}
	}
	written := sc.writtenStates(1)
	for i := range finishBatch + 1 {
		written[int64(i)] = store.StateCompleted
	}
	sc.outcomes(finishBatch + 1)
	sc.done()
	if sc.outs != nil || sc.written != nil {
		t.Fatalf("buffers of a batch larger than %d kept: %d outcomes, %d states", finishBatch, cap(sc.outs), len(sc.written))
	}
	if len(sc.writtenStates(1)) != 0 || len(sc.outcomes(2)) != 2 {
		t.Fatal("buffers not usable again after being dropped")
	}
	var nilScratch *finishScratch
	nilScratch.done() // the claim path's flush has none
}
