package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A capped queue's claim runs under READ COMMITTED whatever the session's default: its count of
// running jobs must see the claims that committed before it took the queue's row, which a
// REPEATABLE READ snapshot taken before the lock would miss. A test trigger records the isolation
// level of the claim's transaction.
func TestClaimCappedIsReadCommitted(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`CREATE TABLE seen_isolation (level text)`,
		`CREATE FUNCTION record_isolation() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN INSERT INTO seen_isolation VALUES (current_setting('transaction_isolation')); RETURN NULL; END $$`,
		`CREATE TRIGGER record_isolation AFTER UPDATE ON leash.jobs FOR EACH STATEMENT EXECUTE FUNCTION record_isolation()`,
		`INSERT INTO leash.queues (name, max_running) VALUES ('capq', 5)`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'capq', 'w' FROM generate_series(1, 3)`,
	} {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	cfg := db.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	rr, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer rr.Close()
	jobs, err := store.ClaimCapped(ctx, rr, store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("ClaimCapped = %d jobs, %v; want 3", len(jobs), err)
	}
	rows, err := db.Query(ctx, `SELECT level FROM seen_isolation`)
	if err != nil {
		t.Fatal(err)
	}
	levels, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(levels) != 1 || levels[0] != "read committed" {
		t.Fatalf("the claim ran under %v (%v); want read committed", levels, err)
	}
}

// A capped queue's claim never waits for the queue's row: held by another transaction (another
// claim, a change not yet committed), the claim takes nothing and says the queue is busy at once;
// once the row is free it claims. A queue without a row is claimed by no statement.
func TestClaimCappedPassesHeldRowOver(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`INSERT INTO leash.queues (name, max_running) VALUES ('capq', 5)`,
		`INSERT INTO leash.jobs (queue, kind) SELECT q, 'w' FROM unnest(ARRAY['capq', 'norow']) q, generate_series(1, 3)`,
	} {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `UPDATE leash.queues SET max_running = 4 WHERE name = 'capq'`); err != nil {
		t.Fatal(err)
	}
	p := store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "w", Lease: time.Minute}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	jobs, err := store.ClaimCapped(sctx, db, p)
	if !errors.Is(err, store.ErrQueueBusy) || len(jobs) != 0 {
		t.Fatalf("ClaimCapped with the row held = %d jobs, %v; want ErrQueueBusy", len(jobs), err)
	}
	// The uncapped claim of the same queue, through a stale view, takes nothing either.
	if jobs, err := store.Claim(sctx, db, p); err != nil || len(jobs) != 0 {
		t.Fatalf("Claim of a capped queue = %d jobs, %v; want none", len(jobs), err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	jobs, err = store.ClaimCapped(sctx, db, p)
	if err != nil || len(jobs) != 3 {
		t.Fatalf("ClaimCapped once the row is free = %d jobs, %v; want 3", len(jobs), err)
	}
	for _, claim := range []func() ([]store.ClaimedJob, error){
		func() ([]store.ClaimedJob, error) {
			return store.Claim(sctx, db, store.ClaimParams{Queues: []string{"norow"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		},
		func() ([]store.ClaimedJob, error) {
			return store.Claim(sctx, db, store.ClaimParams{Queues: []string{"norow", "other"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		},
		func() ([]store.ClaimedJob, error) {
			return store.ClaimCapped(sctx, db, store.ClaimParams{Queues: []string{"norow"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		},
	} {
		if jobs, _ := claim(); len(jobs) != 0 {
			t.Fatalf("a queue without a row was claimed: %d jobs", len(jobs))
		}
	}
	if err := store.EnsureQueues(sctx, db, []string{"norow", "norow"}); err != nil {
		t.Fatal(err)
	}
	if jobs, err := store.Claim(sctx, db, store.ClaimParams{Queues: []string{"norow"}, Limit: 10, WorkerID: "w", Lease: time.Minute}); err != nil || len(jobs) != 3 {
		t.Fatalf("Claim once the row exists = %d jobs, %v; want 3", len(jobs), err)
	}
}
