package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Both ways InsertWorkflowJobs inserts: one statement below 256 jobs, COPY from 256.
var workflowInsertPaths = []struct {
	name string
	n    int
}{{"statement", 255}, {"copy", 256}}

// batch is n plain jobs of steps s0..s(n-1).
func batch(n int) []store.WorkflowJob {
	jobs := make([]store.WorkflowJob, n)
	for i := range jobs {
		jobs[i] = store.WorkflowJob{Step: fmt.Sprintf("s%d", i),
			Params: store.InsertParams{Queue: "default", Kind: "k", MaxAttempts: 3}}
	}
	return jobs
}

// insertWorkflowTx inserts jobs into a new workflow in a transaction and commits it; it
// returns the workflow, the error of the insert or of the commit, and whether the transaction
// still ran statements after the failed insert.
func insertWorkflowTx(t *testing.T, db *pgxpool.Pool, prepare func(tx pgx.Tx, wid int64), jobs []store.WorkflowJob) (wid int64, ids []int64, err error, usable bool) {
	t.Helper()
	ctx := context.Background()
	wid = newWorkflow(t, db)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if prepare != nil {
		prepare(tx, wid)
	}
	ids, err = store.InsertWorkflowJobs(ctx, tx, wid, jobs)
	if err != nil {
		_, uerr := tx.Exec(ctx, `SELECT 1`)
		return wid, nil, err, uerr == nil
	}
	return wid, ids, tx.Commit(ctx), true
}

func countJobs(t *testing.T, db *pgxpool.Pool, wid int64) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM leash.jobs WHERE workflow_id = $1`, wid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Hostile input fails a batch on either path with an error that names the problem, and inserts
// nothing: one bad job among good ones, placed last (the COPY has sent the others by then).
func TestAttackWorkflowInsertHostileBothPaths(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cases := []struct {
		name string
		bad  func(j *store.WorkflowJob)
		want string // in the error, either path
	}{
		{"step with NUL", func(j *store.WorkflowJob) { j.Step = "a\x00b" }, "0x00"},
		{"step invalid UTF-8", func(j *store.WorkflowJob) { j.Step = "a\xffb" }, "UTF8"},
		{"step of 1 MB", func(j *store.WorkflowJob) { j.Step = strings.Repeat("x", 1<<20) }, "jobs_workflow_check"},
		{"empty step", func(j *store.WorkflowJob) { j.Step = "" }, "jobs_workflow_check"},
		{"step twice in the batch", func(j *store.WorkflowJob) { j.Step = "s0" }, "jobs_workflow_step_idx"},
		{"invalid JSON payload", func(j *store.WorkflowJob) { j.Params.Payload = []byte(`{"a":`) }, "json"},
		{"payload with NUL escape", func(j *store.WorkflowJob) { j.Params.Payload = []byte(`{"a":"\u0000"}`) }, "Unicode escape"},
		{"payload with NUL byte", func(j *store.WorkflowJob) { j.Params.Payload = []byte("{\"a\":\"\x00\"}") }, "0x00"},
		{"empty payload", func(j *store.WorkflowJob) { j.Params.Payload = []byte{} }, "json"},
		{"invalid JSON trace context", func(j *store.WorkflowJob) { j.Params.TraceContext = []byte(`nope`) }, "json"},
		{"dependency with NUL", func(j *store.WorkflowJob) { j.DependsOn = []string{"s\x001"} }, "not valid UTF-8 without NUL"},
		{"dependency invalid UTF-8", func(j *store.WorkflowJob) { j.DependsOn = []string{"s\xff"} }, "not valid UTF-8 without NUL"},
		{"dependency on an unknown step", func(j *store.WorkflowJob) { j.DependsOn = []string{"nowhere"} }, "unknown step"},
		{"empty dependency", func(j *store.WorkflowJob) { j.DependsOn = []string{""} }, "names no step"},
		{"dependency on itself", func(j *store.WorkflowJob) { j.DependsOn = []string{j.Step} }, "cycle"},
		{"max attempts 0", func(j *store.WorkflowJob) { j.Params.MaxAttempts = 0 }, "check"},
		{"unique key", func(j *store.WorkflowJob) { j.Params.UniqueKey = "u" }, "unique key"},
	}
	for _, c := range cases {
		errs := map[string]error{}
		for _, path := range workflowInsertPaths {
			jobs := batch(path.n)
			c.bad(&jobs[len(jobs)-1])
			wid, _, err, _ := insertWorkflowTx(t, db, nil, jobs)
			if err == nil {
				t.Errorf("%s, %s: inserted", c.name, path.name)
				continue
			}
			errs[path.name] = err
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s, %s: error %q does not say %q", c.name, path.name, err, c.want)
			}
			if n := countJobs(t, db, wid); n != 0 {
				t.Errorf("%s, %s: %d jobs committed", c.name, path.name, n)
			}
		}
		t.Logf("%s:\n  statement: %v\n  copy:      %v", c.name, errs["statement"], errs["copy"])
	}
	// A step the workflow has already.
	for _, path := range workflowInsertPaths {
		jobs := batch(path.n)
		wid, _, err, usable := insertWorkflowTx(t, db, func(tx pgx.Tx, wid int64) {
			exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, $2)`, wid, jobs[100].Step)
		}, jobs)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "23505" || !strings.Contains(err.Error(), "insert workflow jobs") {
			t.Errorf("existing step, %s: %v", path.name, err)
		}
		if usable {
			t.Errorf("existing step, %s: the transaction ran on after the failed insert", path.name)
		}
		if n := countJobs(t, db, wid); n != 0 {
			t.Errorf("existing step, %s: %d jobs committed", path.name, n)
		}
	}
	// A refusal before any statement leaves the transaction usable.
	for _, path := range workflowInsertPaths {
		jobs := batch(path.n)
		jobs[0].Params.UniqueKey = "u"
		if _, _, err, usable := insertWorkflowTx(t, db, nil, jobs); err == nil || !usable {
			t.Errorf("unique key, %s: %v, transaction usable %v", path.name, err, usable)
		}
	}
}

// Dependencies reach the database unchanged on both paths: one that is not valid UTF-8 is
// refused, never read as another step (the one with U+FFFD in its place).
func TestAttackWorkflowInsertDependencyNotRewritten(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	for _, path := range workflowInsertPaths {
		jobs := batch(path.n)
		jobs[0].Step = "a\uFFFD"
		jobs[len(jobs)-1].DependsOn = []string{"a\xff"}
		wid, _, err, _ := insertWorkflowTx(t, db, nil, jobs)
		if err == nil {
			var deps []string
			if err := db.QueryRow(context.Background(), `SELECT depends_on FROM leash.jobs WHERE workflow_id = $1 AND step = $2`,
				wid, jobs[len(jobs)-1].Step).Scan(&deps); err != nil {
				t.Fatal(err)
			}
			t.Errorf("%s: a dependency on %q was inserted as %q", path.name, "a\xff", deps)
		}
	}
}

// Schedules: far future and far past run_at values within PostgreSQL's range, and delays, come
// back as given (to the microsecond) on both paths. (Beyond the range the pool refuses them.)
func TestAttackWorkflowInsertSchedules(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, at := range []time.Time{
		time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC),
		time.Date(-4700, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(1, 1, 1, 0, 0, 0, 1000, time.UTC),
		time.Date(294276, 12, 31, 0, 0, 0, 0, time.UTC),
	} {
		for _, path := range workflowInsertPaths {
			jobs := batch(path.n)
			jobs[7].Params.RunAt = at
			jobs[8].Params.Delay = 1000 * time.Hour
			wid, ids, err, _ := insertWorkflowTx(t, db, nil, jobs)
			if err != nil {
				t.Fatalf("run_at %v, %s: %v", at, path.name, err)
			}
			var got, now time.Time
			var delayed time.Duration
			if err := db.QueryRow(ctx, `SELECT run_at, (SELECT created_at FROM leash.workflows WHERE id = $2) FROM leash.jobs WHERE id = $1`, ids[7], wid).Scan(&got, &now); err != nil {
				t.Fatal(err)
			}
			if !got.Equal(at) {
				t.Errorf("run_at %v, %s: stored %v", at, path.name, got.UTC())
			}
			if err := db.QueryRow(ctx, `SELECT extract(epoch FROM run_at - (SELECT run_at FROM leash.jobs WHERE id = $2))::float8 * interval '1 second' FROM leash.jobs WHERE id = $1`, ids[8], ids[9]).Scan(&delayed); err != nil {
				t.Fatal(err)
			}
			if d := delayed - 1000*time.Hour; d < -time.Second || d > time.Second {
				t.Errorf("delay, %s: run %v after an unscheduled job of the batch", path.name, delayed)
			}
		}
	}
}

// The ids come back in the order of the jobs on both paths, for steps that differ only in
// case, spaces, or Unicode normalisation.
func TestAttackWorkflowInsertIdsInOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	odd := []string{"e\u0301", "\u00e9", "A", "a", "a ", " a", "\uFEFFa", "ss", "\u00df", "\u212b", "\u00c5"}
	for _, path := range workflowInsertPaths {
		jobs := batch(path.n)
		for i, s := range odd {
			jobs[i*20].Step = s
		}
		for i, j := 0, len(jobs)-1; i < j; i, j = i+1, j-1 { // descending steps
			jobs[i], jobs[j] = jobs[j], jobs[i]
		}
		_, ids, err, _ := insertWorkflowTx(t, db, nil, jobs)
		if err != nil {
			t.Fatalf("%s: %v", path.name, err)
		}
		for i, id := range ids {
			var step string
			if err := db.QueryRow(ctx, `SELECT step FROM leash.jobs WHERE id = $1`, id).Scan(&step); err != nil {
				t.Fatal(err)
			}
			if step != jobs[i].Step {
				t.Fatalf("%s: id %d of job %d (step %q) is the job of step %q", path.name, id, i, jobs[i].Step, step)
			}
		}
	}
}

// lockedByOther reports whether another connection finds workflow wid's row locked against a
// DELETE (FOR UPDATE NOWAIT fails).
func lockedByOther(t *testing.T, db *pgxpool.Pool, wid int64) bool {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `SELECT FROM leash.workflows WHERE id = $1 FOR UPDATE NOWAIT`, wid)
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "55P03" {
		return true
	}
	if err != nil {
		t.Fatal(err)
	}
	return false
}

// A savepoint rolled back after a workflow's first insert takes back both the lock and the
// setting: the next insert locks the row again, on both paths.
func TestAttackWorkflowInsertSavepointLocksAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, path := range workflowInsertPaths {
		wid := newWorkflow(t, db)
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exec(t, tx, `SAVEPOINT a`)
		if _, err := store.InsertWorkflowJobs(ctx, tx, wid, batch(path.n)); err != nil {
			t.Fatal(err)
		}
		if !lockedByOther(t, db, wid) {
			t.Errorf("%s: the insert does not lock its workflow", path.name)
		}
		exec(t, tx, `ROLLBACK TO SAVEPOINT a`)
		if lockedByOther(t, db, wid) {
			t.Errorf("%s: the lock outlived its savepoint", path.name)
		}
		var s string
		if err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('leash.workflow_exists', true), '')`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(s, fmt.Sprint(wid)) {
			t.Errorf("%s: the setting %q outlived its savepoint", path.name, s)
		}
		if _, err := store.InsertWorkflowJobs(ctx, tx, wid, batch(path.n)); err != nil {
			t.Fatal(err)
		}
		if !lockedByOther(t, db, wid) {
			t.Errorf("%s: the insert after the rolled back savepoint does not lock its workflow", path.name)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if n := countJobs(t, db, wid); n != path.n {
			t.Errorf("%s: %d jobs", path.name, n)
		}
	}
}

// Inserts alternating between two workflows in one transaction lock both rows and put every job
// in its own workflow.
func TestAttackWorkflowInsertAlternating(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	a, b := newWorkflow(t, db), newWorkflow(t, db)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for i := range 4 {
		for _, wid := range []int64{a, b} {
			jobs := batch(1 + 255*(i%2))
			for k := range jobs {
				jobs[k].Step = fmt.Sprintf("r%d-%d", i, k)
			}
			if _, err := store.InsertWorkflowJobs(ctx, tx, wid, jobs); err != nil {
				t.Fatal(err)
			}
		}
		exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, $2), ('k', $3, $2)`, a, fmt.Sprintf("x%d", i), b)
	}
	if !lockedByOther(t, db, a) || !lockedByOther(t, db, b) {
		t.Error("a workflow of the transaction is not locked")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if na, nb := countJobs(t, db, a), countJobs(t, db, b); na != 2*257+4 || nb != 2*257+4 {
		t.Errorf("jobs %d and %d", na, nb)
	}
}

// A value of leash.workflow_exists from outside the transaction (SET LOCAL before the first
// insert, a session's SET) gets no job into a workflow that does not exist, and a DELETE of an
// empty workflow racing such an insert leaves no job of no workflow.
func TestAttackWorkflowExistsForged(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	var next int64
	if err := db.QueryRow(ctx, `SELECT coalesce(max(id), 0) + 1000000 FROM leash.workflows`).Scan(&next); err != nil {
		t.Fatal(err)
	}
	for _, forge := range []string{`SET LOCAL leash.workflow_exists = '%d'`, `SELECT set_config('leash.workflow_exists', '%d', true)`} {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exec(t, tx, fmt.Sprintf(forge, next))
		_, err = tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'squat')`, next)
		if err == nil {
			err = tx.Commit(ctx)
		}
		tx.Rollback(ctx)
		if err == nil {
			t.Errorf("%q: a job committed into workflow %d, which does not exist", forge, next)
		}
	}
	// A session's setting, left by a plain SET, reaches its later transactions.
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	exec(t, conn, fmt.Sprintf(`SET leash.workflow_exists = '%d'`, next+1))
	_, err = conn.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'squat')`, next+1)
	exec(t, conn, `RESET leash.workflow_exists`)
	if err == nil {
		t.Errorf("a session's SET let a job into workflow %d, which does not exist", next+1)
	}
	// A transaction that writes the setting as leash does (naming itself) skips the check for
	// its own inserts, and for no other transaction: the next one on the connection is checked.
	exec(t, conn, `BEGIN`)
	exec(t, conn, fmt.Sprintf(`SELECT set_config('leash.workflow_exists', '%d:' || pg_current_xact_id(), true)`, next+2))
	_, err = conn.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'squat')`, next+2)
	exec(t, conn, `ROLLBACK`)
	t.Logf("a transaction forging the setting with its own id: %v", err)
	if _, err := conn.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'squat')`, next+2); err == nil {
		t.Errorf("a forged setting outlived its transaction")
	}
	// The race with a DELETE.
	wid := newWorkflow(t, db)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	exec(t, tx, fmt.Sprintf(`SET LOCAL leash.workflow_exists = '%d'`, wid))
	_, insErr := tx.Exec(ctx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, wid)
	done := make(chan error, 1)
	go func() {
		_, err := db.Exec(ctx, `DELETE FROM leash.workflows WHERE id = $1`, wid)
		done <- err
	}()
	waitDoneOrLockWait(t, db, done)
	if insErr == nil {
		insErr = tx.Commit(ctx)
	}
	tx.Rollback(ctx)
	delErr := <-done
	var jobs, rows int
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM leash.jobs WHERE workflow_id = $1), (SELECT count(*) FROM leash.workflows WHERE id = $1)`, wid).Scan(&jobs, &rows); err != nil {
		t.Fatal(err)
	}
	if jobs > 0 && rows == 0 {
		t.Errorf("forged setting: the insert (%v) and the delete (%v) both committed: %d jobs of a deleted workflow", insErr, delErr, jobs)
	}
}

// A transaction that applies its deferred checks early (SET CONSTRAINTS ALL IMMEDIATE) and then
// adds jobs to the same workflow still has them checked at its commit: a cycle, or a dependency
// on a step that does not exist, fails it.
func TestAttackWorkflowGraphCheckedAfterImmediate(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, later := range []string{
		`INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'x', '{y}'), ('k', $1, 'y', '{x}')`,
		`INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'z', '{nowhere}')`,
		`UPDATE leash.jobs SET depends_on = depends_on || '{nowhere}'::text[] WHERE workflow_id = $1 AND step = 'b'`,
	} {
		wid := newWorkflow(t, db)
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step) VALUES ('k', $1, 'a')`, wid)
		exec(t, tx, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('k', $1, 'b', '{a}')`, wid)
		exec(t, tx, `SET CONSTRAINTS ALL IMMEDIATE`)
		exec(t, tx, `SET CONSTRAINTS ALL DEFERRED`)
		_, err = tx.Exec(ctx, later, wid)
		if err == nil {
			err = tx.Commit(ctx)
		}
		tx.Rollback(ctx)
		if err == nil {
			t.Errorf("%s: committed unchecked (states %v)", later, states(t, db, wid))
		}
	}
}
