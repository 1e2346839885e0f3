package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A transaction left open while holding a completing workflow job's row FOR KEY SHARE (a row of
// the application's own table with a foreign key to leash.jobs, a fenced transaction, a report)
// must not hold back the other outcomes of the batch: before workflows, FOR KEY SHARE never
// stopped an outcome.
func TestAttackKeyShareOnDependencyStallsBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	w1, w2 := newWorkflow(t, db), newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, w1)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'x')`, w2)
	got := claimAll(t, db)
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer forgotten.Rollback(ctx)
	exec(t, forgotten, `SELECT FROM leash.jobs WHERE id = $1 FOR KEY SHARE`, got["a"].ID)

	fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	ws, err := store.Finish(fctx, db, []store.Outcome{
		{ID: got["a"].ID, Token: got["a"].Token, State: "completed"},
		{ID: got["x"].ID, Token: got["x"].Token, State: "completed"},
	})
	if err != nil {
		t.Fatalf("a batch with a completion of a KEY SHARE-locked dependency: %v (x of another workflow not written)", err)
	}
	wrote := map[int64]bool{}
	for _, w := range ws {
		wrote[w.ID] = true
	}
	if !wrote[got["x"].ID] {
		t.Fatalf("x's outcome was not written: %v", ws)
	}
}

// A transaction left open while holding a pending job's row (an operator's SELECT ... FOR
// UPDATE, an UPDATE not committed) must not hold back the other outcomes of a batch that
// completes its dependency.
func TestAttackLockedDependentStallsBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	w1, w2 := newWorkflow(t, db), newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, w1)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'x')`, w2)
	got := claimAll(t, db)
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer forgotten.Rollback(ctx)
	exec(t, forgotten, `SELECT FROM leash.jobs WHERE id = $1 FOR UPDATE`, stepID(t, db, w1, "b"))

	fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	ws, err := store.Finish(fctx, db, []store.Outcome{
		{ID: got["a"].ID, Token: got["a"].Token, State: "completed"},
		{ID: got["x"].ID, Token: got["x"].Token, State: "completed"},
	})
	if err != nil {
		t.Fatalf("a batch completing the dependency of a locked pending job: %v (x of another workflow not written)", err)
	}
	wrote := map[int64]bool{}
	for _, w := range ws {
		wrote[w.ID] = true
	}
	if !wrote[got["x"].ID] {
		t.Fatalf("x's outcome was not written: %v", ws)
	}
}

// revoke_workflow revokes every unfinished job: one that leaves running (its attempt failed and
// is retried) while the revocation runs must not escape it and run again.
func TestAttackRevokeWorkflowMissesJobRetriedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'x', NULL), ('k', $1, 'p', '{x}')`, wid)
	got := claimAll(t, db)
	p := stepID(t, db, wid, "p")
	// A transaction holding p for a moment makes revoke_workflow's first statement wait: its
	// snapshot saw x running.
	holder, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	exec(t, holder, `SELECT FROM leash.jobs WHERE id = $1 FOR UPDATE`, p)
	type res struct {
		n   int
		err error
	}
	done := make(chan res, 1)
	go func() {
		n, err := store.RevokeWorkflow(ctx, db, wid, "stop")
		done <- res{n, err}
	}()
	waitForLockWait(t, db)
	// x's attempt fails and is retried, committed while the revocation runs.
	finish(t, db, got["x"], "retryable")
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	var st string
	var revoked bool
	if err := db.QueryRow(ctx, `SELECT state, revoked_at IS NOT NULL FROM leash.jobs WHERE id = $1`, got["x"].ID).Scan(&st, &revoked); err != nil {
		t.Fatal(err)
	}
	if st != "cancelled" || !revoked {
		t.Fatalf("revoke_workflow returned %d, but x is %s (revoked %v): it escaped the revocation and runs again", r.n, st, revoked)
	}
}

// Retention deletes completed jobs (after 24 h by default); a workflow lives longer than that.
// retry_job of a job whose completed dependency was deleted must not leave it pending forever.
func TestAttackRetryAfterRetentionDeletedDependency(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, max_attempts) VALUES ('k', $1, 'a', NULL, 5), ('k', $1, 'b', '{a}', 1)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "completed")
	got = claimAll(t, db)
	finish(t, db, got["b"], "failed")
	if n, err := store.DeleteFinished(ctx, db, true, 0, 100); err != nil || n != 1 {
		t.Fatalf("retention: %d deleted, %v", n, err)
	}
	ok, err := store.RetryJob(ctx, db, got["b"].ID)
	if err != nil {
		return // refused with a reason: acceptable
	}
	if !ok {
		t.Fatal("retry_job of b returned false")
	}
	wantStates(t, db, wid, map[string]string{"b": "available"})
}

// Retention deletes a completed dependency of a join still waiting for another: adding to the
// workflow afterwards (a fan-out, plain SQL) must not fail its commit for the step deleted.
func TestAttackAddAfterRetentionDeletedDependency(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', NULL), ('k', $1, 'join', '{a,b}')`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "completed")
	// Keeping a (the workflow has unfinished jobs) is acceptable; deleting it must not break
	// what follows.
	if n, err := store.DeleteFinished(ctx, db, true, 0, 100); err != nil || n > 1 {
		t.Fatalf("retention: %d deleted, %v", n, err)
	}
	// b, still running, fans out: a child the join waits for too.
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'child')`, wid); err != nil {
			return err
		}
		_, _, err := store.JobWorkflow(ctx, tx, got["b"].ID)
		if err != nil {
			return err
		}
		return store.AddDependencies(ctx, tx, wid, "join", []string{"child"})
	})
	if err != nil {
		t.Fatalf("fan-out after retention deleted a completed dependency of the join: %v", err)
	}
	finish(t, db, got["b"], "completed")
	wantStates(t, db, wid, map[string]string{"join": "pending"})
	c := claimAll(t, db)
	finish(t, db, c["child"], "completed")
	wantStates(t, db, wid, map[string]string{"join": "available"})
}

// unmet is "maintained by the triggers, never by hand"; a client that writes it anyway (the
// checks accept any value >= 0 or NULL), by an update (refused) or an insert (ignored), must not
// get a job run before its dependencies.
func TestAttackUnmetByHandReleasesEarly(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	for _, v := range []string{"0", "NULL"} {
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', NULL), ('k', $1, 'join', '{a,b}')`, wid)
		if _, err := db.Exec(context.Background(), `UPDATE leash.jobs SET unmet = `+v+` WHERE workflow_id = $1 AND step = 'join'`, wid); err == nil {
			t.Errorf("unmet = %s by hand: the update was accepted", v)
		}
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, unmet) VALUES ('k', $1, 'join2', '{a,b}', `+v+`)`, wid)
		got := claimAll(t, db)
		finish(t, db, got["a"], "completed")
		for _, j := range []string{"join", "join2"} {
			if st := states(t, db, wid)[j]; st != "pending" {
				t.Errorf("unmet = %s by hand: %s is %s while b still runs", v, j, st)
			}
		}
		finish(t, db, got["b"], "completed")
	}
}

// A DELETE of a dependency that has not finished (by hand, or a writer of an earlier release
// that deletes instead of cancelling) must not leave its dependents pending forever.
func TestAttackDeleteUnfinishedDependency(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, wid)
	_, err := db.Exec(context.Background(), `DELETE FROM leash.jobs WHERE id = $1`, stepID(t, db, wid, "a"))
	if err != nil {
		return // refused: acceptable
	}
	if st := states(t, db, wid)["b"]; st == "pending" {
		t.Fatalf("b waits forever for a deleted dependency (state %s)", st)
	}
}

// Two dependencies of a join completed by two concurrent transactions release it exactly once.
func TestAttackConcurrentJoinReleasedOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', NULL), ('k', $1, 'c', NULL), ('k', $1, 'join', '{a,b,c}')`, wid)
		got := claimAll(t, db)
		t1, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		t2, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		exec(t, t2, `SELECT 1`) // take t2's snapshot before t1 commits
		finish(t, t1, got["a"], "completed")
		done := make(chan error, 1)
		go func() {
			_, err := store.Finish(ctx, t2, []store.Outcome{{ID: got["b"].ID, Token: got["b"].Token, State: "completed"}})
			if err == nil {
				err = t2.Commit(ctx)
			}
			done <- err
		}()
		waitForLockWait(t, db)
		if err := t1.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		err = <-done
		t2.Rollback(ctx)
		if err != nil {
			var want bool
			if iso == pgx.RepeatableRead {
				want = true // a serialization failure: the writer tries again
			}
			if !want {
				t.Fatalf("%s: %v", iso, err)
			}
			finish(t, db, got["b"], "completed")
		}
		var unmet int
		if err := db.QueryRow(ctx, `SELECT unmet FROM leash.jobs WHERE workflow_id = $1 AND step = 'join'`, wid).Scan(&unmet); err != nil {
			t.Fatal(err)
		}
		wantStates(t, db, wid, map[string]string{"join": "pending"})
		if unmet != 1 {
			t.Errorf("%s: join unmet %d after two of three completed, want 1", iso, unmet)
		}
		finish(t, db, got["c"], "completed")
		wantStates(t, db, wid, map[string]string{"join": "available"})
	}
}

// A workflow's row deleted while its jobs are unfinished (the checks allow it: there is no
// foreign key) must not strand them: a running job can still fan out, and the workflow can
// still be shown.
func TestAttackWorkflowRowDeleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, wid)
	claimAll(t, db)
	if _, err := db.Exec(ctx, `DELETE FROM leash.workflows WHERE id = $1`, wid); err != nil {
		return // refused: acceptable
	}
	if _, err := store.ShowWorkflow(ctx, db, wid, 10); err != nil {
		t.Errorf("show a workflow whose row was deleted, with jobs unfinished: %v", err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'child')`, wid); err != nil {
		t.Errorf("fan-out of a running job whose workflow row was deleted: %v", err)
	}
}
