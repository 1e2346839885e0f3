package pool_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// A fan-out of 256 children or more (copied in) whose lease is lost while the copy waits adds
// nothing: the commit of the fenced transaction fails. A dependency that is no step name is
// refused before any statement.
func TestWorkflowFanOutCopyFenced(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"split": h})
	ctx := context.Background()
	wf, err := pool.InsertWorkflow(ctx, b.db, "fan", []pool.WorkflowJob{{Step: "split", Kind: "split"}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, p)
	j := h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	children := make([]pool.WorkflowJob, 300)
	for i := range children {
		children[i] = pool.WorkflowJob{Step: fmt.Sprintf("child-%d", i), Kind: "k"}
	}
	children[299].DependsOn = []string{"split"}

	bad := append([]pool.WorkflowJob(nil), children...)
	bad[5] = pool.WorkflowJob{Step: "odd", Kind: "k", DependsOn: []string{"child-\xff"}}
	if _, err := j.AddToWorkflowTx(ctx, mustBegin(t, b), bad, nil); !errors.Is(err, pool.ErrInvalidJob) {
		t.Fatalf("a dependency of invalid UTF-8: %v", err)
	}

	// Another transaction holds the workflow's row: the copy waits at its first row.
	hold, err := b.db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(ctx)
	if _, err := hold.Exec(ctx, `SELECT FROM leash.workflows WHERE id = $1 FOR UPDATE`, wf.ID); err != nil {
		t.Fatal(err)
	}
	tx := mustBegin(t, b)
	added := make(chan error, 1)
	go func() {
		_, err := j.AddToWorkflowTx(ctx, tx, children, nil)
		added <- err
	}()
	waitFor(t, 10*time.Second, func() bool {
		var n int
		b.db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE 'copy %'`).Scan(&n)
		return n > 0
	})
	mustExec(t, b.db, "SELECT leash.revoke_job($1, 'stop')", j.ID)
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	if err := hold.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-added; err == nil {
		if err := tx.Commit(ctx); err == nil {
			t.Fatal("a revoked job's fan-out of 300 committed")
		}
	}
	var n int
	if err := b.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE workflow_id = $1`, wf.ID).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d jobs in the workflow (%v)", n, err)
	}
}

// Thousands of outcomes finishing workflow jobs cost about the claims as many plain jobs do:
// each written batch wakes the claim loop once at most, never once per job.
func TestWorkflowCompletionsNoClaimStorm(t *testing.T) {
	t.Parallel()
	const n = 3000
	run := func(db *pgxpool.Pool, insert string) pool.Stats {
		cfg := fastConfig()
		cfg.Concurrency = 100
		cfg.PollInterval = time.Second
		p, _ := setup(t, db, cfg, map[string]pool.Handler{
			"k": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }),
		})
		mustExec(t, db, insert)
		start(t, p)
		waitFor(t, 60*time.Second, func() bool { return p.Stats().Completed == n })
		return p.Stats()
	}
	wf := run(pgtest.Pool(t), fmt.Sprintf(`
		WITH w AS (INSERT INTO leash.workflows (name) SELECT 'one' FROM generate_series(1, %d) RETURNING id)
		INSERT INTO leash.jobs (kind, workflow_id, step) SELECT 'k', id, 'a' FROM w`, n))
	plain := run(pgtest.Pool(t), fmt.Sprintf(`INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, %d)`, n))
	t.Logf("claims: %d for %d workflow jobs, %d for as many plain ones", wf.Claims, n, plain.Claims)
	if wf.Claims > 2*plain.Claims+50 || wf.Claims > n/5 {
		t.Errorf("%d claims for %d workflow completions (%d for plain jobs)", wf.Claims, n, plain.Claims)
	}
}

// A run_at beyond PostgreSQL's range is refused, never stored as another time (the driver's
// microseconds overflow for year -300000, which came back as year 284554); its bounds are stored
// as given, on both ways a workflow is inserted.
func TestInsertRunAtOutsidePostgresRange(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	workflow := func(n int, at time.Time) ([]int64, error) {
		jobs := make([]pool.WorkflowJob, n)
		for i := range jobs {
			jobs[i] = pool.WorkflowJob{Step: fmt.Sprint(i), Kind: "k"}
		}
		jobs[n-1].Opts = &pool.InsertOpts{RunAt: at}
		wf, err := pool.InsertWorkflow(ctx, db, "w", jobs)
		return wf.JobIDs, err
	}
	for _, at := range []time.Time{
		time.Date(-300000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(-4713, 11, 23, 23, 59, 59, 0, time.UTC),
		time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC),
	} {
		if _, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{RunAt: at}); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("Insert run at %v: %v", at, err)
		}
		for _, n := range []int{1, 256} {
			if _, err := workflow(n, at); !errors.Is(err, pool.ErrInvalidJob) {
				t.Errorf("InsertWorkflow of %d, run at %v: %v", n, at, err)
			}
		}
	}
	for _, at := range []time.Time{
		time.Date(-4713, 11, 24, 0, 0, 0, 0, time.UTC),
		time.Date(294276, 12, 31, 23, 59, 59, 999999000, time.UTC),
	} {
		id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{RunAt: at})
		if err != nil {
			t.Fatalf("Insert run at %v: %v", at, err)
		}
		ids := []int64{id}
		for _, n := range []int{1, 256} {
			wids, err := workflow(n, at)
			if err != nil {
				t.Fatalf("InsertWorkflow of %d, run at %v: %v", n, at, err)
			}
			ids = append(ids, wids[n-1])
		}
		for _, id := range ids {
			var got time.Time
			if err := db.QueryRow(ctx, `SELECT run_at FROM leash.jobs WHERE id = $1`, id).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if !got.Equal(at) {
				t.Errorf("run at %v stored as %v", at, got.UTC())
			}
		}
	}
}
