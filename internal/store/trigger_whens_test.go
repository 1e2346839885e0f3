package store_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// PostgreSQL reads the WHEN of every trigger an UPDATE fires from its node text, and plans it,
// once per statement: every claim and every outcome batch pays for the text of the triggers on
// UPDATE OF state, whatever its rows. Migration 031 cut it from 20,412 bytes to 12,150; a trigger
// that adds much must say why it is worth that on every claim.
func TestStateUpdateTriggersReadLittleNodeText(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	var n, count int
	if err := db.QueryRow(context.Background(), `
		SELECT coalesce(sum(length(t.tgqual)), 0), count(*)
		FROM pg_trigger t
		WHERE t.tgrelid = 'leash.jobs'::regclass AND NOT t.tgisinternal AND t.tgenabled <> 'D'
		  AND t.tgtype & 16 <> 0
		  AND (cardinality(t.tgattr::int2[]) = 0
		       OR (SELECT a.attnum FROM pg_attribute a WHERE a.attrelid = t.tgrelid AND a.attname = 'state') = ANY (t.tgattr::int2[]))`).Scan(&n, &count); err != nil {
		t.Fatal(err)
	}
	if count < 9 {
		t.Fatalf("%d triggers on UPDATE OF state found, want at least 9: the query no longer finds them", count)
	}
	if n > 12500 {
		t.Errorf("the %d triggers an UPDATE of leash.jobs' state fires carry %d bytes of WHEN node text, want at most 12,500", count, n)
	}
}

func count(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// The key triggers' short WHENs: an UPDATE that names the columns without changing them, and a
// keyed job's claim, wake nothing; a change of a named column wakes the key.
func TestKeyTriggersWakeOnlyForChanges(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	exec(t, db, `SELECT leash.set_queue_max_running_per_key('kq', 1)`)
	var keyed, plain int64
	if err := db.QueryRow(context.Background(), `INSERT INTO leash.jobs (kind, queue, concurrency_key) VALUES ('k', 'kq', 'a') RETURNING id`).Scan(&keyed); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(context.Background(), `INSERT INTO leash.jobs (kind, queue) VALUES ('k', 'kq') RETURNING id`).Scan(&plain); err != nil {
		t.Fatal(err)
	}
	wakes := func() int { return count(t, db, `SELECT count(*) FROM leash.key_wakes WHERE queue = 'kq'`) }
	clear := func() { exec(t, db, `DELETE FROM leash.key_wakes`) }
	clear()

	exec(t, db, `UPDATE leash.jobs SET state = state, run_at = run_at, priority = priority, queue = queue,
		concurrency_key = concurrency_key, attempted_at = attempted_at, revoked_at = revoked_at WHERE id = $1`, keyed)
	if n := wakes(); n != 0 {
		t.Errorf("an UPDATE that changed nothing appended %d key wakes", n)
	}
	exec(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour',
		attempted_at = now() WHERE id = $1`, keyed)
	if n := wakes(); n != 0 {
		t.Errorf("a keyed job's claim appended %d key wakes", n)
	}
	exec(t, db, `UPDATE leash.jobs SET state = 'retryable', lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, keyed)
	if n := count(t, db, `SELECT count(*) FROM leash.key_wakes WHERE queue = 'kq' AND key = 'a'`); n != 1 {
		t.Errorf("a keyed job put back appended %d wakes of its key, want 1", n)
	}
	clear()
	exec(t, db, `UPDATE leash.jobs SET priority = 3 WHERE id = $1`, keyed)
	if n := wakes(); n != 1 {
		t.Errorf("a keyed job's new priority appended %d key wakes, want 1", n)
	}
	clear()

	// A job without a key in a queue with a per-key limit: queued again wakes the queue's jobs
	// without a key (key ''), written with its state unchanged does not.
	exec(t, db, `UPDATE leash.jobs SET state = 'available' WHERE id = $1`, plain)
	if n := wakes(); n != 0 {
		t.Errorf("an unkeyed job written available while available appended %d key wakes", n)
	}
	exec(t, db, `UPDATE leash.jobs SET state = 'retryable' WHERE id = $1`, plain)
	if n := count(t, db, `SELECT count(*) FROM leash.key_wakes WHERE queue = 'kq' AND key = ''`); n != 1 {
		t.Errorf("an unkeyed job made retryable appended %d wakes of key '', want 1", n)
	}
}

// The workflow triggers' short WHENs: the rows that now call their functions to no effect get
// none. A completed job written completed again does not count off its dependents twice; a
// failed job written cancelled is not retried (its dependency not met does not make it pending);
// a may_fail job that fails releases its dependents and leaves the transaction's lock_timeout as
// it was.
func TestWorkflowTriggersActOnlyOnTheirCases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on, may_fail, max_attempts) VALUES
		('k', $1, 'a', NULL, NULL, 1), ('k', $1, 'x', NULL, NULL, 1), ('k', $1, 'b', '{a,x}', NULL, 1),
		('k', $1, 'opt', NULL, true, 1), ('k', $1, 'after_opt', '{opt}', NULL, 1)`, wid)
	got := claimAll(t, db)
	finish(t, db, got["a"], "completed")
	wantStates(t, db, wid, map[string]string{"a": "completed", "b": "pending"})
	a, b := stepID(t, db, wid, "a"), stepID(t, db, wid, "b")

	exec(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now() WHERE id = $1`, a)
	if n := count(t, db, `SELECT unmet FROM leash.jobs WHERE id = $1`, b); n != 1 {
		t.Errorf("b's unmet is %d after a was written completed twice, want 1 (x has not completed)", n)
	}
	wantStates(t, db, wid, map[string]string{"b": "pending"})

	// opt may fail: its failure releases after_opt, and the statement's trigger leaves the
	// lock_timeout the transaction set, however short leash.outcome_lock_wait is.
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	exec(t, tx, `SET LOCAL lock_timeout = '7s'`)
	exec(t, tx, `SELECT set_config('leash.outcome_lock_wait', '250ms', true)`)
	exec(t, tx, `UPDATE leash.jobs SET state = 'failed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL,
		leased_by = NULL WHERE id = $1`, got["opt"].ID)
	var lt string
	if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil {
		t.Fatal(err)
	}
	if lt != "7s" {
		t.Errorf("lock_timeout is %s after a may_fail job failed, want 7s as the transaction set it", lt)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wantStates(t, db, wid, map[string]string{"opt": "failed", "after_opt": "available"})

	// x completes, b runs and fails for good; x is put back, so b has a dependency not met. b
	// written cancelled stays cancelled: only a failed or cancelled job queued again is retried.
	finish(t, db, got["x"], "completed")
	got = claimAll(t, db)
	if got["b"].ID == 0 {
		t.Fatalf("b not claimed once a and x completed: %v", got)
	}
	finish(t, db, got["b"], "failed")
	exec(t, db, `UPDATE leash.jobs SET state = 'available', finished_at = NULL WHERE id = $1`, stepID(t, db, wid, "x"))
	exec(t, db, `UPDATE leash.jobs SET state = 'cancelled' WHERE id = $1`, b)
	wantStates(t, db, wid, map[string]string{"b": "cancelled", "x": "available"})
}

// A revoked job finishes as it was written (completed stays completed), except that a revoked
// running job written failed is cancelled, and a revoked queued one is cancelled at once.
func TestRevokedRowsKeepTheirRule(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ids := make([]int64, 3)
	for i := range ids {
		if err := db.QueryRow(context.Background(), `INSERT INTO leash.jobs (kind) VALUES ('k') RETURNING id`).Scan(&ids[i]); err != nil {
			t.Fatal(err)
		}
	}
	exec(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour' WHERE id = ANY ($1)`, ids[:2])
	exec(t, db, `UPDATE leash.jobs SET revoked_at = now() WHERE id = ANY ($1)`, ids)
	exec(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, ids[0])
	exec(t, db, `UPDATE leash.jobs SET state = 'failed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, ids[1])
	for i, want := range []string{"completed", "cancelled", "cancelled"} {
		var st string
		if err := db.QueryRow(context.Background(), `SELECT state FROM leash.jobs WHERE id = $1`, ids[i]).Scan(&st); err != nil {
			t.Fatal(err)
		}
		if st != want {
			t.Errorf("revoked job %d: state %s, want %s", i, st, want)
		}
	}
}

// Migration 031 replaces triggers with CREATE OR REPLACE TRIGGER, which enables each one it
// replaces: a trigger an operator disabled, or enabled for replicas only, stays as it was.
func TestShortWhensMigrationKeepsTriggersAsSet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	all, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	var upTo30 []store.Migration
	for _, m := range all {
		if m.Version <= 30 {
			upTo30 = append(upTo30, m)
		}
	}
	if _, err := store.ApplyMigrations(ctx, db, upTo30); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_finished`)
	exec(t, db, `ALTER TABLE leash.jobs ENABLE REPLICA TRIGGER jobs_key_changed`)
	exec(t, db, `ALTER TABLE leash.jobs ENABLE ALWAYS TRIGGER jobs_revoked_stays_stopped`)
	applied, err := store.ApplyMigrations(ctx, db, all)
	if err != nil || len(applied) == 0 || applied[0].Version != 31 {
		t.Fatalf("applied %v: %v", versions(applied, migVersion), err)
	}
	want := map[string]string{"jobs_workflow_finished": "D", "jobs_key_changed": "R", "jobs_revoked_stays_stopped": "A",
		"jobs_workflow_completing": "O", "jobs_unkeyed_requeued": "O"}
	for name, st := range want {
		var got string
		if err := db.QueryRow(ctx, `SELECT tgenabled::text FROM pg_trigger WHERE tgrelid = 'leash.jobs'::regclass AND tgname = $1`, name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != st {
			t.Errorf("%s: tgenabled %s after migration 031, want %s", name, got, st)
		}
	}
}

// calls runs sql in a transaction that counts calls of PL/pgSQL functions, and returns how many
// times each leash function ran for it (the backend's counts after, less those before: counts
// not yet reported by earlier transactions of the session show too).
func calls(t *testing.T, db *pgxpool.Pool, sql string, args ...any) map[string]int {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	read := func() map[string]int {
		rows, err := tx.Query(ctx, `SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE schemaname = 'leash'`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[string]int{}
		for rows.Next() {
			var name string
			var n int
			if err := rows.Scan(&name, &n); err != nil {
				t.Fatal(err)
			}
			out[name] = n
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	exec(t, tx, `SET LOCAL track_functions = 'pl'`)
	before := read()
	exec(t, tx, sql, args...)
	out := read()
	for name, n := range out {
		if n -= before[name]; n == 0 {
			delete(out, name)
		} else {
			out[name] = n
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return out
}

// The writes of every job's life call no trigger function for jobs the triggers have nothing to
// do for: a keyed job's claim and its outcome's key wake only; a workflow's fan-out claimed and
// completed calls only what releases the join; the cancellation of a failed job's dependents
// and their restoration by its retry call neither the completion's nor the retry's function
// for each dependent.
func TestStateWritesCallOnlyTheTriggersTheyNeed(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	exec(t, db, `SELECT leash.set_queue_max_running_per_key('kq', 10)`)
	exec(t, db, `INSERT INTO leash.jobs (kind, queue, concurrency_key) SELECT 'k', 'kq', 'key' || (g % 3) FROM generate_series(1, 50) g`)
	got := calls(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour',
		attempt = attempt + 1, attempted_at = now() WHERE queue = 'kq'`)
	if len(got) != 0 {
		t.Errorf("the claim of 50 keyed jobs called %v, want nothing", got)
	}
	got = calls(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE queue = 'kq'`)
	if len(got) != 1 || got["wake_concurrency_keys"] != 50 {
		t.Errorf("completing 50 keyed jobs called %v, want wake_concurrency_keys 50 times alone", got)
	}

	wid := newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, max_attempts) SELECT 'k', $1, 'c' || g, 1 FROM generate_series(1, 50) g`, wid)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) SELECT 'k', $1, 'join', array_agg('c' || g) FROM generate_series(1, 50) g`, wid)
	got = calls(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour'
		WHERE workflow_id = $1 AND state = 'available'`, wid)
	if len(got) != 0 {
		t.Errorf("the claim of 50 jobs of a workflow called %v, want nothing", got)
	}
	got = calls(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL
		WHERE workflow_id = $1 AND state = 'running'`, wid)
	if got["workflow_job_completing"] != 50 || got["workflow_job_finished"] != 0 || got["workflow_job_retried"] != 0 {
		t.Errorf("completing 50 jobs of a workflow called %v, want workflow_job_completing 50 times, and neither finished nor retried", got)
	}
	wantStates(t, db, wid, map[string]string{"join": "available"})

	wid = newWorkflow(t, db)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, max_attempts) VALUES ('k', $1, 'root', 1)`, wid)
	exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) SELECT 'k', $1, 'd' || g, '{root}' FROM generate_series(1, 50) g`, wid)
	root := stepID(t, db, wid, "root")
	exec(t, db, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour' WHERE id = $1`, root)
	got = calls(t, db, `UPDATE leash.jobs SET state = 'failed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, root)
	if got["workflow_job_completing"] != 0 || got["workflow_job_retried"] != 0 {
		t.Errorf("a failure cancelling 50 dependents called %v, want neither workflow_job_completing nor workflow_job_retried", got)
	}
	wantStates(t, db, wid, map[string]string{"d1": "cancelled", "d50": "cancelled"})
	got = calls(t, db, `SELECT leash.retry_job($1)`, root)
	if got["workflow_job_completing"] != 0 || got["workflow_job_retried"] != 1 {
		t.Errorf("a retry restoring 50 dependents called %v, want workflow_job_retried once (the retried job) and no workflow_job_completing", got)
	}
	wantStates(t, db, wid, map[string]string{"root": "available", "d1": "pending", "d50": "pending"})
}
