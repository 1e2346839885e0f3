package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// newWorkflow inserts a workflow row and returns its id.
func newWorkflow(t *testing.T, db store.DBTX) int64 {
	t.Helper()
	var wid int64
	if err := db.QueryRow(context.Background(), `INSERT INTO leash.workflows (name) VALUES ('t') RETURNING id`).Scan(&wid); err != nil {
		t.Fatal(err)
	}
	return wid
}

// states returns the state of each step of workflow wid.
func states(t *testing.T, db store.DBTX, wid int64) map[string]string {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT step, state FROM leash.jobs WHERE workflow_id = $1`, wid)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var s, st string
		if err := rows.Scan(&s, &st); err != nil {
			t.Fatal(err)
		}
		out[s] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func wantStates(t *testing.T, db store.DBTX, wid int64, want map[string]string) {
	t.Helper()
	got := states(t, db, wid)
	for s, st := range want {
		if got[s] != st {
			t.Errorf("step %s: state %q, want %q (all: %v)", s, got[s], st, got)
		}
	}
}

func stepID(t *testing.T, db store.DBTX, wid int64, step string) int64 {
	t.Helper()
	var id int64
	if err := db.QueryRow(context.Background(), `SELECT id FROM leash.jobs WHERE workflow_id = $1 AND step = $2`, wid, step).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// claimAll claims every runnable job of queue default and returns the steps claimed.
func claimAll(t *testing.T, db *pgxpool.Pool) map[string]store.ClaimedJob {
	t.Helper()
	jobs, err := ensureAndClaim(context.Background(), db, store.ClaimParams{Queues: []string{"default"}, Limit: 1000, WorkerID: "w", Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]store.ClaimedJob{}
	for _, j := range jobs {
		var step string
		if err := db.QueryRow(context.Background(), `SELECT coalesce(step, '') FROM leash.jobs WHERE id = $1`, j.ID).Scan(&step); err != nil {
			t.Fatal(err)
		}
		out[step] = j
	}
	return out
}

func finish(t *testing.T, db store.DBTX, j store.ClaimedJob, st string) {
	t.Helper()
	w, err := store.Finish(context.Background(), db, []store.Outcome{{ID: j.ID, Token: j.Token, State: st}})
	if err != nil || len(w) != 1 {
		t.Fatalf("finish %d as %s: %v (%d written)", j.ID, st, err, len(w))
	}
}

// A workflow inserted from plain SQL in one statement, dependencies listed after their
// dependents: the jobs with dependencies are pending, never claimed, and each is released by
// the outcome that completes its last dependency, in that transaction.
func TestWorkflowPlainSQL(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES
		('k', $1, 'join', '{a,b}'), ('k', $1, 'b', '{a}'), ('k', $1, 'a', NULL)`, wid)
	wantStates(t, db, wid, map[string]string{"a": "available", "b": "pending", "join": "pending"})

	got := claimAll(t, db)
	if len(got) != 1 || got["a"].ID == 0 {
		t.Fatalf("claimed %v, want a alone", got)
	}
	finish(t, db, got["a"], "completed")
	wantStates(t, db, wid, map[string]string{"a": "completed", "b": "available", "join": "pending"})
	got = claimAll(t, db)
	if len(got) != 1 || got["b"].ID == 0 {
		t.Fatalf("claimed %v, want b alone", got)
	}
	// A plain UPDATE, as a worker of an earlier release or a script writes an outcome.
	exec(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, got["b"].ID)
	wantStates(t, db, wid, map[string]string{"join": "available"})
	if got := claimAll(t, db); got["join"].ID == 0 {
		t.Fatalf("join not claimed: %v", got)
	}
}

// The claim never picks a pending job, even one whose run_at is long past and whose queue has
// nothing else; and a pending row can only belong to a workflow. The claim statement is 0.3.0's
// (store.Claim has not changed since), which is what workers of that release run against a
// migrated database.
func TestWorkflowPendingNeverClaimed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, run_at) VALUES ('k', $1, 'a', now() - interval '1 day')`, wid)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, run_at) VALUES ('k', $1, 'b', '{a}', now() - interval '1 day')`, wid)
	a := stepID(t, db, wid, "a")
	exec(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour' WHERE id = $1`, a)
	if got := claimAll(t, db); len(got) != 0 {
		t.Fatalf("claimed %v with only a pending job queued", got)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, state) VALUES ('k', 'pending')`); err == nil {
		t.Fatal("a pending job without a workflow was inserted")
	}
}

// A dependency that fails for good cancels its dependents and theirs, each naming the cause,
// except through a may_fail job, whose dependents run anyway; retry_job of the failed job
// makes its cancelled dependents pending again.
func TestWorkflowFailureCancelsAndRetryRestores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, may_fail, max_attempts) VALUES
		('k', $1, 'a', NULL, NULL, 1), ('k', $1, 'b', '{a,x}', NULL, 20), ('k', $1, 'c', '{b}', NULL, 20),
		('k', $1, 'opt', '{a}', true, 20), ('k', $1, 'after_opt', '{opt}', NULL, 20), ('k', $1, 'x', NULL, NULL, 20)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "failed")
	// x completes after b was cancelled: b's count must still learn of it when a is retried.
	finish(t, db, got["x"], "completed")
	wantStates(t, db, wid, map[string]string{"a": "failed", "b": "cancelled", "c": "cancelled", "opt": "cancelled", "after_opt": "available"})
	var reason string
	if err := db.QueryRow(ctx, `SELECT last_error FROM leash.jobs WHERE id = $1`, stepID(t, db, wid, "c")).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "dependency a (job") || !strings.Contains(reason, "failed") {
		t.Errorf("c's last_error %q does not name the failed dependency", reason)
	}
	// Retrying c alone cannot work: its dependency is cancelled.
	if _, err := store.RetryJob(ctx, db, stepID(t, db, wid, "c")); err == nil || !strings.Contains(err.Error(), "retry that one first") {
		t.Errorf("retry of c while b is cancelled: %v", err)
	}
	if ok, err := store.RetryJob(ctx, db, stepID(t, db, wid, "a")); err != nil || !ok {
		t.Fatalf("retry a: %v %v", ok, err)
	}
	wantStates(t, db, wid, map[string]string{"a": "available", "b": "pending", "c": "pending", "opt": "pending"})
	got = claimAll(t, db)
	if got["a"].ID == 0 {
		t.Fatalf("a not claimed after its retry: %v", got)
	}
	finish(t, db, got["a"], "completed")
	wantStates(t, db, wid, map[string]string{"b": "available", "c": "pending", "opt": "available"})
}

// Unknown steps, cycles and duplicate steps are refused at commit, whole.
func TestWorkflowRefusesBadGraphs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for name, tc := range map[string]struct{ rows, want string }{
		"unknown":   {`('k', $1, 'a', '{nope}')`, "unknown step nope"},
		"cycle":     {`('k', $1, 'a', '{c}'), ('k', $1, 'b', '{a}'), ('k', $1, 'c', '{b}'), ('k', $1, 'd', NULL)`, "cycle"},
		"self":      {`('k', $1, 'a', '{a}')`, "cycle"},
		"duplicate": {`('k', $1, 'a', NULL), ('k', $1, 'a', NULL)`, "jobs_workflow_step_idx"},
		"no step":   {`('k', $1, NULL, NULL)`, "jobs_workflow_check"},
		"empty dep": {`('k', $1, 'a', '{""}')`, "names no step"},
	} {
		wid := newWorkflow(t, db)
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES `+tc.rows, wid)
		if err == nil {
			err = tx.Commit(ctx)
		}
		tx.Rollback(ctx)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", name, err, tc.want)
		}
		if n := len(states(t, db, wid)); n != 0 {
			t.Errorf("%s: %d jobs inserted", name, n)
		}
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', 999999, 'a')`); err == nil {
		t.Error("a job of an unknown workflow was inserted")
	}
}

// A job added to a workflow that waits for a dependency completed concurrently is settled
// either way: the outcome waits for the adding transaction, or the adding transaction sees the
// completion.
func TestWorkflowAddRacesCompletion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for i := range 2 {
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, wid)
		got := claimAll(t, db)
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'late', '{a}')`, wid); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			// The adding transaction settles first (it locks a), then the outcome commits.
			if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err != nil {
				t.Fatal(err)
			}
		}
		done := make(chan error, 1)
		go func() {
			_, err := store.Finish(ctx, db, []store.Outcome{{ID: got["a"].ID, Token: got["a"].Token, State: "completed"}})
			done <- err
		}()
		if i == 0 {
			// The outcome waits for tx (it holds a FOR KEY SHARE).
			waitForLockWait(t, db)
		} else if err := <-done; err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		wantStates(t, db, wid, map[string]string{"a": "completed", "late": "available"})
	}
}

// waitForLockWait returns once some session of db's database waits for a lock.
func waitForLockWait(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
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
	t.Fatal("no session waits for a lock")
}

// revoke_workflow cancels the queued and pending jobs, revokes the running ones as revoke_job
// does (the holder is notified with its token), and counts them; finished jobs are left alone.
func TestRevokeWorkflow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES
		('k', $1, 'a', NULL), ('k', $1, 'b', NULL), ('k', $1, 'c', '{a}'), ('k', $1, 'd', '{c}'), ('k', $1, 'e', NULL)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["e"], "completed")
	l, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close(context.Background()) })
	exec(t, l, "LISTEN job_revoked")
	n, err := store.RevokeWorkflow(ctx, db, wid, "stop all")
	if err != nil {
		t.Fatal(err)
	}
	// a and b run (claimed), c and d pending: all four.
	if n != 4 {
		t.Errorf("revoke_workflow returned %d, want 4", n)
	}
	wantStates(t, db, wid, map[string]string{"a": "running", "b": "running", "c": "cancelled", "d": "cancelled", "e": "completed"})
	var revoked int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE workflow_id = $1 AND revoked_at IS NOT NULL AND revoke_reason = 'stop all'`, wid).Scan(&revoked); err != nil {
		t.Fatal(err)
	}
	if revoked != 4 {
		t.Errorf("%d jobs carry the revocation, want 4", revoked)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	seen := map[string]bool{}
	for len(seen) < 2 {
		m, err := l.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("revocations heard: %v: %v", seen, err)
		}
		seen[m.Payload] = true
	}
	// Renewal, the fallback when a notification is lost, finds the revocation too.
	renewed, err := store.Renew(ctx, db, store.RenewParams{IDs: []int64{got["a"].ID}, Tokens: []int64{got["a"].Token}, Lease: time.Minute})
	if err != nil || len(renewed) != 0 {
		t.Errorf("renewal of a revoked job: %v %v", renewed, err)
	}
	// Its attempt ends cancelled, whatever it returns.
	finish(t, db, got["a"], "failed")
	wantStates(t, db, wid, map[string]string{"a": "cancelled"})
}

// A workflow row locked by a forgotten transaction stops neither claims nor outcomes of its
// jobs, nor inserts of other workflows' jobs.
func TestWorkflowRowLockedStopsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', NULL), ('k', $1, 'b', '{a}')`, wid)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	exec(t, tx, `SELECT FROM leash.workflows WHERE id = $1 FOR UPDATE`, wid)
	exec(t, db, `SET lock_timeout = '2s'`)
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := db.Acquire(qctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	exec(t, conn, `SET lock_timeout = '2s'`)
	jobs, err := ensureAndClaim(qctx, conn, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim beside a locked workflow row: %v, %d jobs", err, len(jobs))
	}
	finish(t, conn, jobs[0], "completed")
	wantStates(t, conn, wid, map[string]string{"b": "available"})
	other := newWorkflow(t, conn)
	exec(t, conn, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'x')`, other)
}

// Outcomes of jobs outside workflows and of workflow jobs without dependents find the jobs
// waiting for them through the edge table's primary key, never by a scan.
func TestWorkflowReleaseUsesIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step) SELECT 'k', $1, 's' || i FROM generate_series(1, 2000) i`, wid)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) SELECT 'k', $1, 'd' || i, ARRAY['s' || i] FROM generate_series(1, 2000) i`, wid)
	exec(t, db, `ANALYZE leash.jobs`)
	exec(t, db, `ANALYZE leash.workflow_edges`)
	var plan string
	rows, err := db.Query(ctx, `EXPLAIN UPDATE leash.jobs d SET unmet = d.unmet - 1 FROM leash.workflow_edges e
		WHERE e.workflow_id = $1 AND e.step = 's1' AND d.id = e.job_id AND d.state = 'pending'`, wid)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan += line + "\n"
	}
	if strings.Contains(plan, "Seq Scan") {
		t.Errorf("the release scans a table:\n%s", plan)
	}
}

// Revoking a pending job (leash.revoke_job, or UPDATE ... SET revoked_at, which names no state)
// cancels it and the jobs waiting for it; revoking a may_fail one lets them run.
func TestRevokePendingJobCancelsDependents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, may_fail) VALUES
		('k', $1, 'a', NULL, NULL), ('k', $1, 'b', '{a}', NULL), ('k', $1, 'c', '{b}', NULL),
		('k', $1, 'opt', '{a}', true), ('k', $1, 'after_opt', '{opt}', NULL)`, wid)
	if ok, err := store.Revoke(ctx, db, stepID(t, db, wid, "b"), "no"); err != nil || !ok {
		t.Fatalf("revoke b: %v %v", ok, err)
	}
	exec(t, db, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, stepID(t, db, wid, "opt"))
	wantStates(t, db, wid, map[string]string{"a": "available", "b": "cancelled", "c": "cancelled", "opt": "cancelled", "after_opt": "available"})
}

// Hostile shapes: a workflow of 100,000 jobs inserted by one statement (a split, 99,998 parts
// and a join waiting for all of them), released by one outcome each way; a chain 1,000 deep,
// cancelled from its head by one failure and put back by one retry, neither running out of
// stack; names too long for the index refused with a clear error.
func TestWorkflowHostileSizes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wide := newWorkflow(t, db)
	began := time.Now()
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on)
		SELECT 'k', $1::bigint, 'p' || i, NULL::text[] FROM generate_series(1, 99998) i
		UNION ALL SELECT 'k', $1, 'join', (SELECT array_agg('p' || i) FROM generate_series(1, 99998) i)
		UNION ALL SELECT 'k', $1, 'split', NULL`, wide)
	t.Logf("100,000-job workflow inserted in %s", time.Since(began))
	wantStates(t, db, wide, map[string]string{"split": "available", "p1": "available", "join": "pending"})
	began = time.Now()
	exec(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now() WHERE workflow_id = $1 AND step LIKE 'p%'`, wide)
	wantStates(t, db, wide, map[string]string{"join": "available"})
	t.Logf("99,998 completions released the join in %s", time.Since(began))

	deep := newWorkflow(t, db)
	began = time.Now()
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, max_attempts)
		SELECT 'k', $1, 'c' || i, CASE WHEN i > 0 THEN ARRAY['c' || (i - 1)] END, 1 FROM generate_series(0, 999) i`, deep)
	t.Logf("chain of 1,000 inserted in %s", time.Since(began))
	head := stepID(t, db, deep, "c0")
	exec(t, db, `UPDATE leash.jobs SET state = 'failed', finished_at = now() WHERE id = $1`, head)
	var cancelled int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE workflow_id = $1 AND state = 'cancelled'`, deep).Scan(&cancelled); err != nil {
		t.Fatal(err)
	}
	if cancelled != 999 {
		t.Fatalf("%d of 999 jobs of the chain cancelled", cancelled)
	}
	if ok, err := store.RetryJob(ctx, db, head); err != nil || !ok {
		t.Fatalf("retry the head: %v %v", ok, err)
	}
	wantStates(t, db, deep, map[string]string{"c0": "available", "c1": "pending", "c999": "pending"})
	t.Logf("chain of 1,000 inserted, cancelled and put back in %s", time.Since(began))

	for _, bad := range []string{strings.Repeat("x", 1025), strings.Repeat("é", 600)} {
		w := newWorkflow(t, db)
		if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, $2)`, w, bad); err == nil ||
			!strings.Contains(err.Error(), "jobs_workflow_check") {
			t.Errorf("a %d-byte step: %v", len(bad), err)
		}
		if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'a', $2)`, w, []string{bad}); err == nil ||
			!strings.Contains(err.Error(), "names no step") {
			t.Errorf("a %d-byte dependency: %v", len(bad), err)
		}
		if _, err := db.Exec(ctx, `INSERT INTO leash.workflows (name) VALUES ($1)`, bad+bad); err == nil {
			t.Errorf("a %d-byte workflow name was stored", 2*len(bad))
		}
	}
}

// A workflow large enough to be copied in writes the same rows as one inserted by the statement,
// in chunks below the copy's threshold: states, unmet counts, dependencies, may_fail, payloads,
// priorities, attempts, schedules, timeouts, trace contexts and concurrency keys; and the ids returned are each
// step's own, in the order given.
func TestWorkflowCopiedAsInserted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	n := store.CopyWorkflowJobsMin + 44
	jobs := make([]store.WorkflowJob, n)
	for i := range jobs {
		j := store.WorkflowJob{Step: fmt.Sprintf("s%03d", n-i), Params: store.InsertParams{
			Queue: "default", Kind: "k", MaxAttempts: int32(1 + i%5), Priority: int16(i % 3),
			Payload: []byte(fmt.Sprintf(`{"i": %d}`, i)),
		}}
		switch i % 6 {
		case 1:
			j.DependsOn = []string{jobs[i-1].Step}
		case 2:
			j.DependsOn = []string{jobs[0].Step, jobs[i-1].Step}
			j.MayFail = true
		case 3:
			j.Params.Delay = time.Hour
		case 4:
			j.Params.Timeout = 1500 * time.Millisecond
			j.Params.TraceContext = []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)
		case 5:
			j.Params.RunAt = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
			j.Params.ConcurrencyKey = fmt.Sprintf("tenant-%d", i%7)
		}
		jobs[i] = j
	}
	insert := func(chunk int) (int64, []int64) {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		wid := newWorkflow(t, tx)
		var ids []int64
		for from := 0; from < n; from += chunk {
			got, err := store.InsertWorkflowJobs(ctx, tx, wid, jobs[from:min(from+chunk, n)])
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, got...)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return wid, ids
	}
	copied, copiedIDs := insert(n)
	inserted, insertedIDs := insert(store.CopyWorkflowJobsMin - 1)
	read := func(wid int64, ids []int64) []string {
		rows, err := db.Query(ctx, `
			SELECT format('%s %s %s %s %s %s %s run_at+%s %s %s %s %s %s key %s', j.step, j.queue, j.kind, j.payload, j.priority,
			              j.max_attempts, j.state, CASE WHEN j.run_at > '2029-01-01' THEN j.run_at::text
			                                            ELSE (j.run_at - j.created_at)::text END,
			              j.timeout, j.trace_context, j.depends_on, j.may_fail, j.unmet, j.concurrency_key)
			FROM unnest($2::bigint[]) WITH ORDINALITY AS i(id, ord) JOIN leash.jobs j ON j.id = i.id
			WHERE j.workflow_id = $1 ORDER BY i.ord`, wid, ids)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, b := read(copied, copiedIDs), read(inserted, insertedIDs)
	if len(a) != n || len(b) != n {
		t.Fatalf("read %d copied and %d inserted jobs by the ids returned, want %d each", len(a), len(b), n)
	}
	for i := range a {
		if a[i] != b[i] {
			t.Errorf("job %d: copied %q, inserted %q", i, a[i], b[i])
		}
		if !strings.HasPrefix(a[i], jobs[i].Step+" ") {
			t.Errorf("id %d returned for step %s is job %q", copiedIDs[i], jobs[i].Step, a[i])
		}
	}
}

// The insert trigger skips its function only for a job it would leave unchanged: after the first
// job of a workflow in a transaction, a job written 'pending' without dependencies is still made
// available, an unmet count written by hand is still dropped, and a job naming a workflow that
// does not exist is still refused.
func TestWorkflowInsertSkipsOnlyWhatItWouldNotChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	wid := newWorkflow(t, tx)
	exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'first')`, wid)
	exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step, state, unmet) VALUES
		('k', $1, 'plain', 'available', NULL), ('k', $1, 'pending', 'pending', NULL), ('k', $1, 'counted', 'available', 7)`, wid)
	rows, err := tx.Query(ctx, `SELECT format('%s %s %s', step, state, coalesce(unmet::text, '-')) FROM leash.jobs WHERE workflow_id = $1 ORDER BY id`, wid)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"first available -", "plain available -", "pending available -", "counted available -"}
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("jobs %v, want %v", got, want)
	}
	_, err = tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'x'), ('k', $1 + 1000, 'y')`, wid)
	if err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("a job of a workflow that does not exist, after one of an existing workflow: %v; want it refused", err)
	}
}

// The release that ends an outcome statement reads the jobs waiting for the completed ones
// through the edges' primary key, one probe per completed job, under the statistics of a fresh
// fan-out (10,000 edges analyzed, where a hash join over a scan of every edge looked cheaper):
// the plan the statement ran, read with auto_explain, has no sequential scan of
// leash.workflow_edges or leash.jobs.
func TestWorkflowReleaseReadsEdgesByIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	const n = 10000
	jobs := make([]store.WorkflowJob, n+1)
	steps := make([]string, n)
	for i := range steps {
		steps[i] = fmt.Sprintf("c%d", i)
		jobs[i] = store.WorkflowJob{Step: steps[i], Params: store.InsertParams{Queue: "default", Kind: "k", MaxAttempts: 3}}
	}
	jobs[n] = store.WorkflowJob{Step: "join", DependsOn: steps, Params: store.InsertParams{Queue: "default", Kind: "k", MaxAttempts: 3}}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	wid := newWorkflow(t, tx)
	if _, err := store.InsertWorkflowJobs(ctx, tx, wid, jobs); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `ANALYZE leash.jobs`)
	exec(t, db, `ANALYZE leash.workflow_edges`)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var plans []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		plans = append(plans, n.Message)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `LOAD 'auto_explain'`); err != nil {
		t.Skipf("auto_explain is not installed: %v", err)
	}
	for _, s := range []string{"auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
		"auto_explain.log_analyze = on", "client_min_messages = log"} {
		if _, err := conn.Exec(ctx, "SET "+s); err != nil {
			t.Fatal(err)
		}
	}
	for range 6 { // past the five executions after which a cached plan may turn generic
		claimed, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 100, WorkerID: "w", Lease: time.Minute})
		if err != nil || len(claimed) == 0 {
			t.Fatalf("claimed %d: %v", len(claimed), err)
		}
		outs := make([]store.Outcome, len(claimed))
		for i, j := range claimed {
			outs[i] = store.Outcome{ID: j.ID, Token: j.Token, State: "completed"}
		}
		if _, err := store.Finish(ctx, conn, outs); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	releases := 0
	for _, p := range plans {
		if !strings.Contains(p, "WITH waiting AS") {
			continue
		}
		releases++
		if strings.Contains(p, "Seq Scan on workflow_edges") || strings.Contains(p, "Seq Scan on jobs") {
			t.Fatalf("the release scanned a table:\n%s", p)
		}
	}
	if releases != 6 {
		t.Fatalf("%d plans of the release read, want 6", releases)
	}
}
