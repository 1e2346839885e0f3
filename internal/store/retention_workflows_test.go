package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Retention deletes a workflow's row once its jobs are gone and it is older than the retention
// age, in bounded batches; never one that has jobs, nor one a transaction is inserting a job
// into (the insert commits, and the workflow is kept with its job).
func TestDeleteEmptyWorkflows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	old := func() int64 {
		wid := newWorkflow(t, db)
		exec(t, db, `UPDATE leash.workflows SET created_at = now() - interval '1 hour' WHERE id = $1`, wid)
		return wid
	}
	exists := func(wid int64) bool {
		var ok bool
		if err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM leash.workflows WHERE id = $1)`, wid).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	withJob, young, inserting := old(), newWorkflow(t, db), old()
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, state, finished_at) VALUES ('k', $1, 'a', 'completed', now())`, withJob)
	var empty []int64
	for range 5 {
		empty = append(empty, old())
	}
	ins, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer ins.Rollback(ctx)
	exec(t, ins, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'late')`, inserting)

	var total int64
	for {
		n, err := store.DeleteEmptyWorkflows(ctx, db, time.Minute, 2)
		if err != nil {
			t.Fatal(err)
		}
		if n > 2 {
			t.Fatalf("a batch of 2 deleted %d", n)
		}
		total += n
		if n < 2 {
			break
		}
	}
	if total != int64(len(empty)) {
		t.Errorf("deleted %d workflows, want the %d empty old ones", total, len(empty))
	}
	for _, wid := range empty {
		if exists(wid) {
			t.Errorf("empty workflow %d kept", wid)
		}
	}
	if err := ins.Commit(ctx); err != nil {
		t.Fatalf("the insert beside retention: %v", err)
	}
	for name, wid := range map[string]int64{"with a job": withJob, "young": young, "being inserted into": inserting} {
		if !exists(wid) {
			t.Errorf("workflow %s (%d) deleted", name, wid)
		}
	}
	// Its jobs gone, the workflow goes at the next pass.
	exec(t, db, `DELETE FROM leash.jobs WHERE workflow_id IN ($1, $2)`, withJob, inserting)
	if n, err := store.DeleteEmptyWorkflows(ctx, db, time.Minute, 100); err != nil || n != 2 {
		t.Fatalf("after their jobs were deleted: %d deleted, %v", n, err)
	}
}

// A retention DELETE that meets a workflow whose job committed after its statement began passes
// it by instead of failing (the row trigger sees the job); a DELETE of anyone else is refused.
func TestDeleteEmptyWorkflowsPassesByWorkflowWithJobs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, wid)
	if _, err := db.Exec(ctx, `DELETE FROM leash.workflows WHERE id = $1`, wid); err == nil {
		t.Fatal("a DELETE of a workflow with jobs was accepted")
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	exec(t, tx, `SELECT set_config('leash.workflow_retention', 'on', true)`)
	tag, err := tx.Exec(ctx, `DELETE FROM leash.workflows WHERE id = $1`, wid)
	if err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("retention's DELETE of a workflow with jobs: %d deleted, %v", tag.RowsAffected(), err)
	}
}
