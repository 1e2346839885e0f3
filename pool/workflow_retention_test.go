package pool_test

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// Retention deletes a finished workflow's jobs and then its row; a workflow with a job still
// waiting keeps its row and every job.
func TestRetentionDeletesFinishedWorkflows(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.RetainCompleted, cfg.RetainFailed = time.Millisecond, time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{
		"step": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }),
	})
	done, err := pool.InsertWorkflow(ctx, db, "done", []pool.WorkflowJob{
		{Step: "a", Kind: "step"}, {Step: "b", Kind: "step", DependsOn: []string{"a"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	waiting, err := pool.InsertWorkflow(ctx, db, "waiting", []pool.WorkflowJob{
		{Step: "a", Kind: "step"}, {Step: "b", Kind: "step", DependsOn: []string{"a"}},
		{Step: "later", Kind: "step", Opts: &pool.InsertOpts{RunAt: time.Now().Add(time.Hour)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	start(t, p)
	b.events.wait(t, 4, 10*time.Second)
	time.Sleep(5 * time.Millisecond) // past the retention of a millisecond
	if _, err := p.PruneOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.GetWorkflow(ctx, db, done.ID, 10); err == nil {
		t.Errorf("the finished workflow's row outlived its jobs")
	}
	info, err := pool.GetWorkflow(ctx, db, waiting.ID, 10)
	if err != nil || len(info.Steps) != 3 {
		t.Fatalf("the unfinished workflow: %+v, %v", info, err)
	}
}
