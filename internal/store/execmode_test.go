package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func TestFinishUnderExecMode(t *testing.T) {
	url := pgtest.URL(t)
	db0 := pgtest.PoolFor(t, url)
	ctx := context.Background()
	if err := store.EnsureQueues(ctx, db0, []string{"default"}); err != nil {
		t.Fatal(err)
	}
	exec(t, db0, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	cfg, _ := pgxpool.ParseConfig(url + "&default_query_exec_mode=exec")
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	jobs, err := store.Claim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 1 {
		t.Fatal(jobs, err)
	}
	_, err = store.Finish(ctx, db, []store.Outcome{{ID: jobs[0].ID, Token: jobs[0].Token, State: store.StateCompleted}})
	if err != nil {
		t.Fatal(err)
	}
}
