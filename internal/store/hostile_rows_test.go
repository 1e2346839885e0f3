package store_test

// Rows any SQL client may write, read and written by the statements that must not fail for the
// other rows because of them.

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// The operator's reads (job list, failures, status) beside one row holding timestamps the table
// accepts (±infinity): each read covers every row of its kind, so one such row must not make it
// fail for all of them.
func TestAdminReadsBesideInfiniteTimestamps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		row  string // an INSERT of one hostile row
		read func(db store.DBTX, b store.Beginner) error
	}{
		{"list beside run_at infinity", `INSERT INTO leash.jobs (kind, run_at) VALUES ('k', 'infinity')`,
			func(db store.DBTX, b store.Beginner) error {
				_, err := store.ListJobs(ctx, b, store.ListParams{})
				return err
			}},
		{"list beside created_at -infinity", `INSERT INTO leash.jobs (kind, created_at) VALUES ('k', '-infinity')`,
			func(db store.DBTX, b store.Beginner) error {
				_, err := store.ListJobs(ctx, b, store.ListParams{})
				return err
			}},
		{"list beside finished_at infinity", `INSERT INTO leash.jobs (kind, state, finished_at) VALUES ('k', 'completed', 'infinity')`,
			func(db store.DBTX, b store.Beginner) error {
				_, err := store.ListJobs(ctx, b, store.ListParams{})
				return err
			}},
		{"failures beside run_at infinity", `INSERT INTO leash.jobs (kind, state, run_at, finished_at) VALUES ('k', 'failed', 'infinity', now())`,
			func(db store.DBTX, b store.Beginner) error { _, err := store.RecentFailures(ctx, db, 10); return err }},
		{"failures beside attempted_at -infinity", `INSERT INTO leash.jobs (kind, state, attempted_at) VALUES ('k', 'retryable', '-infinity')`,
			func(db store.DBTX, b store.Beginner) error { _, err := store.RecentFailures(ctx, db, 10); return err }},
		{"status beside run_at -infinity", `INSERT INTO leash.jobs (kind, run_at) VALUES ('k', '-infinity')`,
			func(db store.DBTX, b store.Beginner) error { _, err := store.ReadLiveStatus(ctx, db, 10); return err }},
		{"status beside a lease that never expires", `INSERT INTO leash.jobs (kind, state, lease_token, leased_by, lease_expires_at, heartbeat_at)
			VALUES ('k', 'running', 1, 'w', 'infinity', now())`,
			func(db store.DBTX, b store.Beginner) error { _, err := store.ReadLiveStatus(ctx, db, 10); return err }},
		{"status beside heartbeat_at -infinity", `INSERT INTO leash.jobs (kind, state, lease_token, leased_by, lease_expires_at, heartbeat_at)
			VALUES ('k', 'running', 1, 'w', now() + interval '1 hour', '-infinity')`,
			func(db store.DBTX, b store.Beginner) error { _, err := store.ReadLiveStatus(ctx, db, 10); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			mustExecStore(t, db, `INSERT INTO leash.jobs (kind) VALUES ('fine')`)
			mustExecStore(t, db, tc.row)
			if err := tc.read(db, db); err != nil {
				t.Fatalf("read beside one hostile row: %v", err)
			}
		})
	}
}

// A snooze or retry delay of the largest Duration ("never before an operator looks") stays
// within the timestamps PostgreSQL holds: the outcome, and the batch it is in, are written.
func TestFinishWithTheLongestDelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for range 2 {
		insertRow(t, db, "long", "", "")
	}
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"long"}, Limit: 2, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 2 {
		t.Fatalf("claim: %v, %v", jobs, err)
	}
	outs := []store.Outcome{
		{ID: jobs[0].ID, Token: jobs[0].Token, State: store.StateAvailable, RunIn: time.Duration(math.MaxInt64), ReturnAttempt: true},
		{ID: jobs[1].ID, Token: jobs[1].Token, State: store.StateCompleted},
	}
	if ws, err := store.Finish(ctx, db, outs); err != nil || len(ws) != 2 {
		t.Fatalf("finish a snooze of the longest Duration beside a completion: %v, %v", ws, err)
	}
}

// retry_job of a job the claim set aside (failed at attempt 2147483647) runs it once more, its
// count started again (migration 015); it failed with an overflow before.
func TestRetrySetAsideRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	id := insertRow(t, db, "q", ", state, attempt, max_attempts, finished_at", ", 'failed', 2147483647, 2147483647, now()")
	if _, err := store.RetryJob(ctx, db, id); err != nil && strings.Contains(err.Error(), "out of range") {
		t.Fatalf("retry a set-aside row: %v", err)
	} else if err != nil {
		t.Logf("retry: %v", err)
	}
}

func mustExecStore(t *testing.T, db store.DBTX, sql string) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// A running row whose lease never expires (lease_expires_at 'infinity', which the table accepts
// and any client with INSERT may write) is taken back by the rescue like an expired one, so it
// cannot hold a slot of its capped queue for ever, and revoke_job ends it. (Before, no rescue
// took it and the queue's other jobs never started.)
func TestLeaseThatNeverExpiresIsRescued(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	mustExecStore(t, db, `INSERT INTO leash.queues (name, max_running) VALUES ('capped', 1)`)
	var zombie int64
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, state, lease_token, leased_by, lease_expires_at, heartbeat_at)
		VALUES ('capped', 'k', 'running', 1, 'nobody', 'infinity', now()) RETURNING id`).Scan(&zombie); err != nil {
		t.Fatal(err)
	}
	waiting := insertRow(t, db, "capped", "", "")
	if ok, err := store.Revoke(ctx, db, zombie, "operator ends it"); err != nil || !ok {
		t.Fatalf("revoke_job: %v, %v", ok, err)
	}
	if _, err := store.Rescue(ctx, db, 10); err != nil {
		t.Fatal(err)
	}
	jobs, err := store.ClaimCapped(ctx, db, store.ClaimParams{Queues: []string{"capped"}, Limit: 1, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 1 || jobs[0].ID != waiting {
		var state string
		_ = db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, zombie).Scan(&state)
		t.Fatalf("after revoke_job and a rescue, the revoked row is %s and the queue's job is not claimed: %v, %v", state, jobs, err)
	}
}
