package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func claimRated(t *testing.T, db *pgxpool.Pool, queue string, limit int) ([]store.ClaimedJob, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // a claim never waits
	defer cancel()
	jobs, next, err := store.ClaimRated(ctx, db, store.ClaimParams{Queues: []string{queue}, Limit: limit, WorkerID: "w", Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return jobs, next
}

// A queue's rate limit, set by a row inserted with just the column: each claim starts no more
// than the ring has free slots, says how long until the next one frees, and a slot frees one
// period after its start; jobs taken off the queue by any other way are not starts.
func TestClaimRatedRing(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	// Long enough for the three claims below to run inside one period on a loaded machine.
	const period = 2 * time.Second
	execAll(t, db,
		`INSERT INTO leash.queues (name, rate_limit, rate_period) VALUES ('rq', 3, interval '2 seconds')`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'rq', 'k' FROM generate_series(1, 10)`)
	jobs, next := claimRated(t, db, "rq", 2)
	if len(jobs) != 2 || next != 0 {
		t.Fatalf("first claim of 2 took %d, next %s; want 2 and room left", len(jobs), next)
	}
	jobs, next = claimRated(t, db, "rq", 10)
	if len(jobs) != 1 || next <= 0 || next > period {
		t.Fatalf("second claim took %d, next %s; want the third slot and a wait under %s", len(jobs), next, period)
	}
	if jobs, _ := claimRated(t, db, "rq", 10); len(jobs) != 0 {
		t.Fatalf("claim at the limit took %d", len(jobs))
	}
	time.Sleep(next) // the slot's start must age one period on the database clock
	deadline := time.Now().Add(5 * time.Second)
	for {
		jobs, _ = claimRated(t, db, "rq", 10)
		if len(jobs) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(jobs) < 2 {
		t.Fatalf("claim once the first claim's slots freed took %d; want 2 (3 if the third freed meanwhile)", len(jobs))
	}
	var most int
	if err := db.QueryRow(ctx, `
		SELECT max((SELECT count(*) FROM leash.jobs b WHERE b.queue = 'rq' AND b.attempted_at >= a.attempted_at
		              AND b.attempted_at < a.attempted_at + interval '2 seconds'))
		FROM leash.jobs a WHERE a.queue = 'rq' AND a.attempted_at IS NOT NULL`).Scan(&most); err != nil {
		t.Fatal(err)
	}
	if most > 3 {
		t.Fatalf("%d starts in one window of the period; the limit is 3", most)
	}
}

// Changing the limit rebuilds the ring in the changing transaction: raised, the starts already
// made still count; lowered, the latest of them are kept, so the queue starts nothing until
// they age; 0 starts nothing; removed, the queue is claimed as any capped queue.
func TestRateLimitChanged(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_rate_limit('rq', 4, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'rq', 'k' FROM generate_series(1, 30)`)
	if jobs, _ := claimRated(t, db, "rq", 3); len(jobs) != 3 {
		t.Fatalf("took %d; want 3", len(jobs))
	}
	execAll(t, db, `SELECT leash.set_queue_rate_limit('rq', 6, interval '1 hour')`)
	if jobs, next := claimRated(t, db, "rq", 10); len(jobs) != 3 || next < 59*time.Minute {
		t.Fatalf("raised to 6 after 3 starts: took %d, next %s; want 3 and an hour", len(jobs), next)
	}
	execAll(t, db, `SELECT leash.set_queue_rate_limit('rq', 2, interval '1 hour')`)
	if jobs, _ := claimRated(t, db, "rq", 10); len(jobs) != 0 {
		t.Fatalf("lowered to 2 after 6 starts: took %d", len(jobs))
	}
	execAll(t, db, `SELECT leash.set_queue_rate_limit('rq', 2, interval '1 millisecond')`)
	time.Sleep(2 * time.Millisecond) // the period must pass on the database clock
	if jobs, _ := claimRated(t, db, "rq", 10); len(jobs) != 2 {
		t.Fatalf("the period shortened to 1ms: took %d; want 2", len(jobs))
	}
	execAll(t, db, `SELECT leash.set_queue_rate_limit('rq', 0, interval '1 millisecond')`)
	if jobs, _ := claimRated(t, db, "rq", 10); len(jobs) != 0 {
		t.Fatalf("limit 0: took %d", len(jobs))
	}
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.set_queue_rate_limit('rq', NULL)`).Scan(&changed); err != nil || !changed {
		t.Fatalf("remove the limit: %v %v", changed, err)
	}
	var slots int
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM leash.rate_slots) + (SELECT count(*) FROM leash.rate_heads)`).Scan(&slots); err != nil || slots != 0 {
		t.Fatalf("%d ring rows left (%v); want none", slots, err)
	}
	if jobs, next := claimRated(t, db, "rq", 5); len(jobs) != 5 || next != 0 {
		t.Fatalf("without a limit: took %d, next %s", len(jobs), next)
	}
	for _, bad := range []string{
		`SELECT leash.set_queue_rate_limit('rq', -1)`, `SELECT leash.set_queue_rate_limit('rq', 1000001)`,
		`SELECT leash.set_queue_rate_limit('rq', 5, interval '0')`, `SELECT leash.set_queue_rate_limit('rq', 5, interval '32 days')`,
	} {
		if _, err := db.Exec(ctx, bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

// A transaction holding a rate-limited queue's row, its ring's head or one of its slots stops
// that queue's claims (busy, nothing, or a claim that fails after the slot's 100ms lock wait),
// never another queue's, and never for long.
func TestClaimRatedNeverWaits(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	execAll(t, db,
		`SELECT leash.set_queue_rate_limit('rq', 100, interval '1 hour')`,
		`SELECT leash.set_queue_rate_limit('other', 100, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind) SELECT q, 'k' FROM unnest(ARRAY['rq', 'other']) q, generate_series(1, 10)`)
	hold := func(sql string) func() {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return func() { _ = tx.Rollback(context.Background()) }
	}
	claimOther := func(what string) {
		t.Helper()
		start := time.Now()
		if jobs, _ := claimRated(t, db, "other", 1); len(jobs) != 1 || time.Since(start) > 2*time.Second {
			t.Fatalf("with %s held, the other queue's claim took %d in %s", what, len(jobs), time.Since(start))
		}
	}
	params := store.ClaimParams{Queues: []string{"rq"}, Limit: 5, WorkerID: "w", Lease: time.Minute}

	release := hold(`SELECT FROM leash.queues WHERE name = 'rq' FOR UPDATE`)
	if _, _, err := store.ClaimRated(ctx, db, params); !errors.Is(err, store.ErrQueueBusy) {
		t.Fatalf("queue's row held: %v; want ErrQueueBusy", err)
	}
	claimOther("the queue's row")
	release()

	release = hold(`SELECT FROM leash.rate_heads WHERE queue = 'rq' FOR UPDATE`)
	if jobs, _, err := store.ClaimRated(ctx, db, params); err != nil || len(jobs) != 0 {
		t.Fatalf("ring's head held: %d jobs, %v; want none", len(jobs), err)
	}
	claimOther("the ring's head")
	release()

	release = hold(`SELECT FROM leash.rate_slots WHERE queue = 'rq' AND slot = 2 FOR UPDATE`)
	start := time.Now()
	if _, _, err := store.ClaimRated(ctx, db, params); err == nil || time.Since(start) > 2*time.Second {
		t.Fatalf("a slot held: %v after %s; want a lock timeout", err, time.Since(start))
	}
	claimOther("a slot")
	release()
	var running int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE queue = 'rq' AND state = 'running'`).Scan(&running); err != nil || running != 0 {
		t.Fatalf("%d jobs of rq running after the failed claims (%v); want none", running, err)
	}
	if jobs, _ := claimRated(t, db, "rq", 5); len(jobs) != 5 {
		t.Fatalf("once released: took %d; want 5", len(jobs))
	}
}

// A queue with a per-key limit and a rate limit keeps both.
func TestClaimKeyedRated(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		`SELECT leash.set_queue_rate_limit('kq', 3, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kq', 'k', 'key' || (i % 5) FROM generate_series(1, 20) i`)
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 3 {
		t.Fatalf("took %d; want 3 (the rate limit)", len(got))
	}
	execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL,
		leased_by = NULL, lease_expires_at = NULL WHERE state = 'running'`)
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 0 {
		t.Fatalf("took %d after 3 starts; want none", len(got))
	}
	execAll(t, db, `SELECT leash.set_queue_rate_limit('kq', 5, interval '1 hour')`)
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 2 {
		t.Fatalf("raised to 5: took %d; want 2", len(got))
	}
}

// The claims that do not write starts take nothing of a rate-limited queue, as a worker whose
// view of leash.queues predates the limit makes them: the uncapped claim (one queue, many) and
// the capped one.
func TestRateLimitedQueueRefusedElsewhere(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_rate_limit('rq', 3, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'rq', 'k' FROM generate_series(1, 10)`)
	for _, qs := range [][]string{{"rq"}, {"rq", "other"}} {
		jobs, err := store.Claim(ctx, db, store.ClaimParams{Queues: qs, Limit: 10, WorkerID: "w", Lease: time.Minute})
		if err != nil || len(jobs) != 0 {
			t.Fatalf("uncapped claim of %v: %d jobs, %v; want none", qs, len(jobs), err)
		}
	}
	jobs, err := store.ClaimCapped(ctx, db, store.ClaimParams{Queues: []string{"rq"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 0 {
		t.Fatalf("capped claim: %d jobs, %v; want none", len(jobs), err)
	}
	if jobs, _ := claimRated(t, db, "rq", 10); len(jobs) != 3 {
		t.Fatalf("rated claim took %d; want 3", len(jobs))
	}
}
