package pool_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A forgotten transaction holding a pending job's row stops only the outcome of the job that
// releases it: the batch's other outcomes are written at once, and the held one, left running
// under its lease meanwhile, is written once the lock goes, and releases its dependent. Nothing
// is dropped or run twice.
func TestWorkflowHeldDependentHoldsBackOnlyItsRelease(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 10*time.Second, time.Second
	db := pgtest.Pool(t)
	release := make(chan struct{})
	var running atomic.Int32
	p, b := setup(t, db, cfg, map[string]pool.Handler{
		"first": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			running.Add(1)
			<-release
			return nil
		}),
		"then": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }),
	})
	ctx := context.Background()
	var wfs []pool.InsertedWorkflow
	for range 6 {
		wf, err := pool.InsertWorkflow(ctx, db, "held", []pool.WorkflowJob{
			{Step: "a", Kind: "first"}, {Step: "b", Kind: "then", DependsOn: []string{"a"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		wfs = append(wfs, wf)
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return running.Load() == 6 })
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT FROM leash.jobs WHERE id = $1 FOR UPDATE", wfs[0].JobIDs[1]); err != nil {
		t.Fatal(err)
	}
	close(release)
	b.events.wait(t, 10, 10*time.Second) // five a's and their b's
	if r := getRow(t, db, wfs[0].JobIDs[0]); r.State != "running" {
		t.Fatalf("the held release's job is %s while its dependent is locked", r.State)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 2, 10*time.Second)
	for _, wf := range wfs {
		for _, id := range wf.JobIDs {
			if r := getRow(t, db, id); r.State != "completed" || r.Attempt != 1 {
				t.Fatalf("job %d: %+v", id, r)
			}
		}
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d outcomes dropped", n)
	}
}
