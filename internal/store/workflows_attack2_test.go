package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A may_fail dependency that failed for good counted as met for the jobs waiting for it; a
// retry_job of it makes it unfinished again, and its next completion must not count it off a
// second time: the join below still waits for b.
func TestAttackMayFailRetriedCountedTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, may_fail, max_attempts) VALUES
		('k', $1, 'a', NULL, true, 1), ('k', $1, 'b', NULL, NULL, 1), ('k', $1, 'join', '{a,b}', NULL, 1)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "failed")
	wantStates(t, db, wid, map[string]string{"join": "pending"})
	if ok, err := store.RetryJob(ctx, db, got["a"].ID); err != nil || !ok {
		t.Fatalf("retry a: %v %v", ok, err)
	}
	again := claimAll(t, db)
	finish(t, db, again["a"], "completed")
	wantStates(t, db, wid, map[string]string{"join": "pending"}) // b still runs
	finish(t, db, got["b"], "completed")
	wantStates(t, db, wid, map[string]string{"join": "available"})
}

// A completed dependency put back in the queue by hand (an operator re-running a step) is
// waited for again by the jobs still pending: its next completion must not count it off twice.
func TestAttackCompletedDependencyPutBackByHand(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	for _, back := range []string{"available", "running"} {
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES
			('k', $1, 'a', NULL), ('k', $1, 'b', NULL), ('k', $1, 'join', '{a,b}')`, wid)
		got := claimAll(t, db)
		finish(t, db, got["a"], "completed")
		exec(t, db, `UPDATE leash.jobs SET state = $2, finished_at = NULL,
			lease_token = CASE WHEN $2 = 'running' THEN 1 END, lease_expires_at = CASE WHEN $2 = 'running' THEN now() END
			WHERE id = $1`, got["a"].ID, back)
		exec(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, got["a"].ID)
		if st := states(t, db, wid)["join"]; st != "pending" {
			t.Errorf("a set back to %s and completed again: join is %s while b still runs", back, st)
		}
		finish(t, db, got["b"], "completed")
		wantStates(t, db, wid, map[string]string{"join": "available"})
	}
}

// A pending job set to available by hand (an UPDATE of a queue's waiting jobs) would run before
// its dependencies completed, as an unmet written by hand would: it is refused.
func TestAttackPendingSetAvailableByHand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, wid)
	for _, st := range []string{"available", "retryable", "running"} {
		if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = $2,
			lease_token = CASE WHEN $2 = 'running' THEN 1 END, lease_expires_at = CASE WHEN $2 = 'running' THEN now() END
			WHERE id = $1`, stepID(t, db, wid, "b"), st); err == nil {
			t.Errorf("a pending job set to %s by hand: accepted (%v)", st, states(t, db, wid))
		}
	}
	wantStates(t, db, wid, map[string]string{"b": "pending"})
	// Cancelling it by hand stays allowed.
	exec(t, db, `UPDATE leash.jobs SET state = 'cancelled', finished_at = now() WHERE id = $1`, stepID(t, db, wid, "b"))
}

// waitDoneOrLockWait returns once done has a value (put back for the caller) or some session
// waits for a lock.
func waitDoneOrLockWait(t *testing.T, db *pgxpool.Pool, done chan error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-done:
			done <- err
			return
		default:
		}
		var n int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("neither done nor waiting for a lock")
}

// A DELETE of a workflow's row beside a transaction inserting a job into it (a fan-out, or a
// plain-SQL insert) must not leave that job in no workflow: the delete waits for the insert and
// is then refused, or the insert fails.
func TestAttackWorkflowDeleteRacesInsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	{
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, wid)
		exec(t, db, `DELETE FROM leash.jobs WHERE workflow_id = $1`, wid) // a finished and deleted
		ins, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, insErr := ins.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'late')`, wid)
		done := make(chan error, 1)
		go func() {
			_, err := db.Exec(ctx, `DELETE FROM leash.workflows WHERE id = $1`, wid)
			done <- err
		}()
		waitDoneOrLockWait(t, db, done)
		if insErr == nil {
			insErr = ins.Commit(ctx)
		}
		ins.Rollback(ctx)
		delErr := <-done
		var jobs, rows int
		if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM leash.jobs WHERE workflow_id = $1), (SELECT count(*) FROM leash.workflows WHERE id = $1)`, wid).Scan(&jobs, &rows); err != nil {
			t.Fatal(err)
		}
		if jobs > 0 && rows == 0 {
			t.Errorf("the insert (%v) and the delete (%v) both committed: %d jobs of a deleted workflow", insErr, delErr, jobs)
		}
	}
}

// revoke_workflow revokes every unfinished job: a job a plain-SQL fan-out adds, or a failed job
// retry_job puts back, committed while the revocation runs, must not escape it.
func TestAttackRevokeWorkflowMissesJobsAddedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, max_attempts) VALUES
		('k', $1, 'x', NULL, 1), ('k', $1, 'y', NULL, 1), ('k', $1, 'p', '{x}', 1)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["y"], "failed")
	p := stepID(t, db, wid, "p")
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
	// Committed while the revocation waits: a child added, y retried.
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'child')`, wid)
	if ok, err := store.RetryJob(ctx, db, got["y"].ID); err != nil || !ok {
		t.Fatalf("retry y: %v %v", ok, err)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	rows, err := db.Query(ctx, `SELECT step, state FROM leash.jobs WHERE workflow_id = $1 AND state IN ('pending', 'available', 'retryable')`, wid)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var s, st string
		err := r.Scan(&s, &st)
		return s + " " + st, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Fatalf("revoke_workflow returned %d, but %v escaped it and run", r.n, left)
	}
}

// Finish writes a batch in halves when a workflow job's release meets a held row: a half that
// fails after another was written (a deadline, a lost connection) must not hide the outcomes
// written already. Whatever Finish reports as not written is not written, and a retry of the
// batch writes nothing twice.
func TestAttackFinishHidesWrittenHalf(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	w1, w2, w3 := newWorkflow(t, db), newWorkflow(t, db), newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'x')`, w1)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, w2)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'c', NULL), ('k', $1, 'd', '{c}')`, w3)
	got := claimAll(t, db)
	// Forgotten transactions hold a's and c's dependents: their completions wait 100 ms each,
	// and the batch is written in halves.
	for _, h := range []struct {
		wid  int64
		step string
	}{{w2, "b"}, {w3, "d"}} {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		exec(t, tx, `SELECT FROM leash.jobs WHERE id = $1 FOR UPDATE`, stepID(t, db, h.wid, h.step))
	}
	outs := []store.Outcome{
		{ID: got["x"].ID, Token: got["x"].Token, State: "completed"},
		{ID: got["a"].ID, Token: got["a"].Token, State: "completed"},
		{ID: got["c"].ID, Token: got["c"].Token, State: "completed"},
	}
	// [x a c] fails after 100 ms, [x] is written, then [a c] fails, and [a] waits: the deadline
	// comes while the second half runs.
	fctx, cancel := context.WithTimeout(ctx, 250*time.Millisecond)
	ws, err := store.Finish(fctx, db, outs)
	cancel()
	reported := map[int64]bool{}
	for _, w := range ws {
		reported[w.ID] = true
	}
	for _, s := range []string{"x", "a", "c"} {
		var st string
		if err := db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, got[s].ID).Scan(&st); err != nil {
			t.Fatal(err)
		}
		if (st == "completed") != reported[got[s].ID] {
			t.Errorf("%s is %s, but Finish reported it written: %v (err %v)", s, st, reported[got[s].ID], err)
		}
	}
	// Written, x's outcome is not written again; on a machine slow enough that the deadline came
	// before x's half committed, it was not reported, and is written now.
	ws2, err := store.Finish(ctx, db, outs[:1])
	if reported[got["x"].ID] && (err != nil || len(ws2) != 0) {
		t.Errorf("x's outcome written again: %v %v", ws2, err)
	}
	if !reported[got["x"].ID] && (err != nil || len(ws2) != 1) {
		t.Errorf("x's outcome, not written before, was not written now: %v %v", ws2, err)
	}
}

// A completed dependency deleted by hand (or by the retention of a release that did not know
// workflows) while its join still waits for another: when that other fails, the join is
// cancelled, and a retry_job of it puts the join back. The join must not then wait forever for
// the deleted step (pending, and its whole workflow kept by retention): it is cancelled, naming
// the step.
func TestAttackRependedJoinOfDeletedDependency(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, max_attempts) VALUES
		('k', $1, 'a', NULL, 1), ('k', $1, 'b', NULL, 1), ('k', $1, 'join', '{a,b}', 1)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "completed")
	exec(t, db, `DELETE FROM leash.jobs WHERE id = $1`, got["a"].ID)
	finish(t, db, got["b"], "failed")
	wantStates(t, db, wid, map[string]string{"join": "cancelled"})
	if ok, err := store.RetryJob(ctx, db, got["b"].ID); err != nil || !ok {
		t.Fatalf("retry b: %v %v", ok, err)
	}
	again := claimAll(t, db)
	finish(t, db, again["b"], "completed")
	var st, lastErr string
	if err := db.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM leash.jobs WHERE workflow_id = $1 AND step = 'join'`, wid).Scan(&st, &lastErr); err != nil {
		t.Fatal(err)
	}
	if st == "pending" {
		t.Fatalf("join waits forever for the deleted step a (%s)", lastErr)
	}
}

// A job's workflow and step never change and its dependencies are never removed, whoever
// writes them: each UPDATE below is refused.
func TestAttackWorkflowColumnsRewritten(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	w1, w2 := newWorkflow(t, db), newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, w1)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, w2)
	var loose int64
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (kind) VALUES ('k') RETURNING id`).Scan(&loose); err != nil {
		t.Fatal(err)
	}
	a, b := stepID(t, db, w1, "a"), stepID(t, db, w1, "b")
	for _, c := range []struct {
		sql  string
		args []any
	}{
		{`UPDATE leash.jobs SET step = 'c' WHERE id = $1`, []any{b}},
		{`UPDATE leash.jobs SET workflow_id = $2 WHERE id = $1`, []any{b, w2}},
		{`UPDATE leash.jobs SET workflow_id = NULL, step = NULL, depends_on = NULL WHERE id = $1`, []any{b}},
		{`UPDATE leash.jobs SET workflow_id = $2, step = 'z' WHERE id = $1`, []any{loose, w2}},
		{`UPDATE leash.jobs SET workflow_id = $2, step = 'z', depends_on = '{a}' WHERE id = $1`, []any{loose, w2}},
		{`UPDATE leash.jobs SET depends_on = '{}' WHERE id = $1`, []any{b}},
		{`UPDATE leash.jobs SET depends_on = NULL WHERE id = $1`, []any{b}},
	} {
		if _, err := db.Exec(ctx, c.sql, c.args...); err == nil {
			t.Errorf("%s: accepted", c.sql)
		}
	}
	claimAll(t, db)
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET depends_on = '{x}' WHERE id = $1`, a); err == nil {
		t.Errorf("a running job was given a dependency")
	}
	wantStates(t, db, w1, map[string]string{"a": "running", "b": "pending"})
}

// DependencyOutputs of a dependency whose output is large (written by SQL, past
// MaxOutputBytes) reads it whole; a NUL cannot be stored in an output at all (jsonb refuses
// \u0000), so none is ever read.
func TestAttackDependencyOutputsHugeOrNUL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a,a}')`, wid)
	exec(t, db, `UPDATE leash.jobs SET output = jsonb_build_object('big', repeat('x', 16 << 20)) WHERE id = $1`, stepID(t, db, wid, "a"))
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET output = '{"nul": "\u0000"}' WHERE id = $1`, stepID(t, db, wid, "a")); err == nil {
		t.Error("a NUL was stored in an output")
	}
	outs, err := store.DependencyOutputs(ctx, db, stepID(t, db, wid, "b"))
	if err != nil {
		t.Fatal(err)
	}
	if len(outs) != 1 || len(outs["a"]) < 16<<20 {
		t.Fatalf("read %d outputs, a's %d bytes", len(outs), len(outs["a"]))
	}
}

// A fan-out (a fenced transaction of a running job adding a child) still open when
// revoke_workflow commits cannot commit its child: the fence sees the revocation.
func TestAttackRevokeWorkflowBesideFencedFanOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'parent')`, wid)
	got := claimAll(t, db)
	fan, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer fan.Rollback(ctx)
	if err := store.Fence(ctx, fan, got["parent"].ID, got["parent"].Token); err != nil {
		t.Fatal(err)
	}
	exec(t, fan, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'child')`, wid)
	if n, err := store.RevokeWorkflow(ctx, db, wid, "stop"); err != nil || n != 1 {
		t.Fatalf("revoke_workflow beside an open fan-out: %d, %v", n, err)
	}
	if err := fan.Commit(ctx); err == nil {
		t.Fatalf("the fan-out of a revoked job committed: %v", states(t, db, wid))
	}
	if st, ok := states(t, db, wid)["child"]; ok {
		t.Fatalf("the child of a revoked job is %s", st)
	}
}
