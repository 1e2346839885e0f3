package store_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func completeAll(t *testing.T, db interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, ids []int64) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		lease_token = NULL, lease_expires_at = NULL WHERE id = ANY ($1)`, ids); err != nil {
		t.Fatal(err)
	}
}

func countKeys(jobs []store.ClaimedJob) map[string]int {
	out := map[string]int{}
	for _, j := range jobs {
		out[j.ConcurrencyKey]++
	}
	return out
}

// A per-key rate limit alone: each key starts at most its limit in the window, whatever else
// has room; finished jobs still count (a start is a start); jobs without a key are not limited;
// another key is not held back by a key out of room.
func TestClaimKeyRateLimit(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kr', 2, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kr', 'w', k FROM unnest(ARRAY['a','a','a','a','a','b','b','b']) k`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'kr', 'w' FROM generate_series(1, 3)`)
	jobs := claimKeyed(t, db, "kr", 100, true)
	if got := countKeys(jobs); got["a"] != 2 || got["b"] != 2 || got[""] != 3 || len(jobs) != 7 {
		t.Fatalf("first claim took %v by key; want a:2 b:2 and the 3 without a key", got)
	}
	completeAll(t, db, claimedIDs(jobs))
	if got := claimKeyed(t, db, "kr", 100, true); len(got) != 0 {
		t.Fatalf("claim with every key out of room took %v; want nothing", countKeys(got))
	}
	// A new key starts at once.
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kr', 'w', 'c'), ('kr', 'w', 'c'), ('kr', 'w', 'c')`)
	if got := countKeys(claimKeyed(t, db, "kr", 100, false)); got["c"] != 2 || len(got) != 1 {
		t.Fatalf("claim after key c's insert took %v; want c:2 alone", got)
	}
	var starts []time.Time
	if err := db.QueryRow(ctx, `SELECT starts FROM leash.key_rates WHERE queue = 'kr' AND key = 'a'`).Scan(&starts); err != nil {
		t.Fatal(err)
	}
	if len(starts) != 2 {
		t.Errorf("key a's recorded starts: %v; want 2", starts)
	}
	// Keys out of room are placed at the end of their window: the claims walk none of them.
	var due int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.concurrency_keys WHERE queue = 'kr' AND next_run_at <= now()`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	if due != 0 {
		t.Errorf("%d keys out of room are due in leash.concurrency_keys; want none", due)
	}
}

// A per-key rate limit beside a per-key limit: a key starts only when both have room.
func TestClaimKeyRateWithPerKeyLimit(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kp', 3, interval '1 hour')`,
		`SELECT leash.set_queue_max_running_per_key('kp', 2)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kp', 'w', 'a' FROM generate_series(1, 10)`)
	first := claimKeyed(t, db, "kp", 100, false)
	if len(first) != 2 {
		t.Fatalf("first claim took %d; want 2 (the per-key limit)", len(first))
	}
	completeAll(t, db, claimedIDs(first))
	second := claimKeyed(t, db, "kp", 100, false)
	if len(second) != 1 {
		t.Fatalf("second claim took %d; want 1 (the third start of the window)", len(second))
	}
	completeAll(t, db, claimedIDs(second))
	if got := claimKeyed(t, db, "kp", 100, false); len(got) != 0 {
		t.Fatalf("third claim took %d; want none (3 starts in the window)", len(got))
	}
}

// The claim says when the next key has room again, and a claim then starts it; never earlier.
// A retry counts as a start too.
func TestClaimKeyRateSaysWhen(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kw', 1, interval '2 seconds')`, // the claims below fit in it
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kw', 'w', 'a' FROM generate_series(1, 3)`)
	claim := func() ([]store.ClaimedJob, time.Duration) {
		t.Helper()
		jobs, next, err := store.ClaimKeyed(ctx, db, store.KeyedParams{
			ClaimParams: store.ClaimParams{Queues: []string{"kw"}, Limit: 10, WorkerID: "w", Lease: time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		return jobs, next
	}
	jobs, next := claim()
	if len(jobs) != 1 {
		t.Fatalf("first claim took %d; want 1", len(jobs))
	}
	if next <= 0 || next > 2*time.Second {
		t.Fatalf("first claim says the key has room again in %s; want within 2s", next)
	}
	// The job fails and is to run again at once: it waits for room too.
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'retryable', run_at = now(), lease_token = NULL,
		lease_expires_at = NULL WHERE id = $1`, jobs[0].ID); err != nil {
		t.Fatal(err)
	}
	again, next2 := claim()
	if len(again) != 0 {
		t.Fatalf("claim within the window took %v; want nothing", claimedIDs(again))
	}
	if next2 <= 0 || next2 > next {
		t.Fatalf("claim within the window says %s; want at most %s", next2, next)
	}
	time.Sleep(next2 + 5*time.Millisecond)
	// One start again: the key's first job in (priority, run_at, id) order, job 2 (the retried
	// job's run_at is later; without a per-key limit a key has no order of its own).
	later, _ := claim()
	if ids := claimedIDs(later); !slices.Equal(ids, []int64{2}) {
		t.Fatalf("claim once the window passed took %v; want job 2", ids)
	}
}

// A limit of 0 starts no job with a key (and those without one still start); removed, the
// queue's starts go and every key starts again.
func TestClaimKeyRateZeroAndRemoved(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kz', 1, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kz', 'w', 'a'), ('kz', 'w', 'a'), ('kz', 'w', NULL)`)
	if got := countKeys(claimKeyed(t, db, "kz", 10, false)); got["a"] != 1 || got[""] != 1 {
		t.Fatalf("first claim took %v; want one job of key a and the one without a key", got)
	}
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kz', 0, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kz', 'w', 'b'), ('kz', 'w', NULL)`)
	if got := countKeys(claimKeyed(t, db, "kz", 10, true)); got["a"] != 0 || got["b"] != 0 || got[""] != 1 {
		t.Fatalf("claim under a limit of 0 took %v; want the new job without a key alone", got)
	}
	var rows int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_rates WHERE queue = 'kz'`).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("key_rates rows of kz under a changed limit: %d, %v; want the 1 kept", rows, err)
	}
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kz', NULL)`)
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_rates WHERE queue = 'kz'`).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("key_rates rows of kz once the limit is removed: %d, %v; want none", rows, err)
	}
	got, err := store.Claim(ctx, db, store.ClaimParams{Queues: []string{"kz"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(got) != 2 {
		t.Fatalf("uncapped claim once the limit is removed: %d jobs, %v; want key a's second and key b's", len(got), err)
	}
}

// Bounds as the table's check keeps them, for any SQL client.
func TestKeyRateLimitBounds(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, bad := range []string{
		`SELECT leash.set_queue_key_rate_limit('kb', -1)`,
		`SELECT leash.set_queue_key_rate_limit('kb', 1001)`,
		`SELECT leash.set_queue_key_rate_limit('kb', 1, interval '-1 year 361 days')`,
		`SELECT leash.set_queue_rate_limit('kb', 1, interval '-1 year 361 days')`,
		`SELECT leash.set_queue_key_rate_limit('kb', 1, interval '0')`,
		`SELECT leash.set_queue_key_rate_limit('kb', 1, interval '1 year')`,
		`SELECT leash.set_queue_key_rate_limit('kb', 1, interval '-1 second')`,
		`INSERT INTO leash.queues (name, key_rate_limit, key_rate_period) VALUES ('kb2', 1, interval '1 month 2 days')`,
	} {
		_, err := db.Exec(ctx, bad)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
			t.Errorf("%s: %v; want a check violation", bad, err)
		}
	}
	// 31 days, and a month of 30 days (what the interval compares as), are within bounds.
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kb', 1000, interval '31 days')`,
		`SELECT leash.set_queue_key_rate_limit('kb3', 1, interval '1 month')`)
}

// Retention deletes the starts of keys whose window has passed, and of queues without the limit,
// and keeps the others.
func TestDeleteIdleKeyRates(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('ki', 2, interval '1 minute')`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES
		   ('ki', 'old', ARRAY[now() - interval '3 minutes']),
		   ('ki', 'new', ARRAY[now() - interval '90 seconds', now() - interval '3 minutes']),
		   ('ki', 'empty', '{}'),
		   ('gone', 'x', ARRAY[now()])`)
	n, err := store.DeleteIdleKeyRates(ctx, db, 1000)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	if err := db.QueryRow(ctx, `SELECT array_agg(queue || '/' || key ORDER BY key) FROM leash.key_rates`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if n != 3 || !slices.Equal(left, []string{"ki/new"}) {
		t.Fatalf("deleted %d, left %v; want 3 deleted and ki/new left", n, left)
	}
	// Wakes of a queue not claimed key by key (a repeatable read writer's, while another queue
	// has a limit) go too; those of a keyed queue stay for its claims.
	execAll(t, db, `DELETE FROM leash.key_wakes`,
		`INSERT INTO leash.key_wakes (queue, key) VALUES ('plain', 'x'), ('plain', ''), ('ki', 'y')`)
	if _, err := store.DeleteIdleKeyRates(ctx, db, 1000); err != nil {
		t.Fatal(err)
	}
	var wakes []string
	if err := db.QueryRow(ctx, `SELECT array_agg(queue || '/' || key ORDER BY queue, key) FROM leash.key_wakes`).Scan(&wakes); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(wakes, []string{"ki/y"}) {
		t.Fatalf("wakes left %v; want ki/y alone", wakes)
	}
}

// A producer's transaction open as the queue's first limit is set: its insert's trigger saw no
// limit and woke no key, and the limit's look at the queue's keys did not see the uncommitted
// job. Once it commits, the claims find the job all the same (leash.key_sweeps).
func TestKeyRateLimitSetBesideProducer(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	producer, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Rollback(ctx)
	var id int64
	if err := producer.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kp2', 'w', 'late') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kp2', 5)`)
	if got := claimKeyed(t, db, "kp2", 10, false); len(got) != 0 {
		t.Fatalf("claim before the producer committed took %v", claimedIDs(got))
	}
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := claimedIDs(claimKeyed(t, db, "kp2", 10, false))
		if slices.Equal(got, []int64{id}) {
			break
		}
		if len(got) != 0 || time.Now().After(deadline) {
			t.Fatalf("claims once the producer committed took %v; want job %d", got, id)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var sweeps int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_sweeps`).Scan(&sweeps); err != nil || sweeps != 0 {
		t.Fatalf("sweeps left: %d, %v; want none once done", sweeps, err)
	}
}

// A key's starts row held by a forgotten transaction fails the claim of its queue within the
// claims' lock timeout, and no other queue's.
func TestKeyRatesRowHeldStopsOnlyItsQueue(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kh', 5, interval '1 hour')`,
		`SELECT leash.set_queue_key_rate_limit('kh2', 5, interval '1 hour')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kh', 'w', 'a'), ('kh', 'w', 'a'), ('kh2', 'w', 'a')`)
	if got := claimKeyed(t, db, "kh", 1, false); len(got) != 1 {
		t.Fatalf("first claim took %d; want 1", len(got))
	}
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer forgotten.Rollback(ctx)
	if _, err := forgotten.Exec(ctx, `SELECT FROM leash.key_rates WHERE queue = 'kh' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	_, _, err = store.ClaimKeyed(ctx, db, store.KeyedParams{
		ClaimParams: store.ClaimParams{Queues: []string{"kh"}, Limit: 1, WorkerID: "w", Lease: time.Minute}})
	if err == nil || !strings.Contains(err.Error(), "lock timeout") {
		t.Fatalf("claim with a key's starts held: %v; want a lock timeout", err)
	}
	if d := time.Since(began); d > 5*time.Second {
		t.Fatalf("claim with a key's starts held took %s", d)
	}
	if got := claimKeyed(t, db, "kh2", 10, false); len(got) != 1 {
		t.Fatalf("claim of another queue took %d; want 1", len(got))
	}
	if err := forgotten.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := claimKeyed(t, db, "kh", 1, false); len(got) != 1 {
		t.Fatalf("claim once the transaction ended took %d; want 1", len(got))
	}
}

// A job without a key inserted while its keyed queue has no room (at its cap, or paused) is taken
// by the first claim with room, not left to the periodic look: a claim without room leaves the
// insert's wake for the next.
func TestClaimKeyedWithoutRoomKeepsUnkeyedWake(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kc', 1)`,
		`UPDATE leash.queues SET max_running = 1 WHERE name = 'kc'`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kc', 'w', 'a')`)
	settleKeyed(t, db, "kc")
	first := claimKeyed(t, db, "kc", 10, false)
	if len(first) != 1 {
		t.Fatalf("first claim took %d; want key a's job", len(first))
	}
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind) VALUES ('kc', 'w')`)
	if got := claimKeyed(t, db, "kc", 10, false); len(got) != 0 {
		t.Fatalf("claim at the cap took %v; want nothing", claimedIDs(got))
	}
	execAll(t, db, `SELECT leash.pause_queue('kc')`)
	if got := claimKeyed(t, db, "kc", 10, false); len(got) != 0 {
		t.Fatalf("claim of the paused queue took %v; want nothing", claimedIDs(got))
	}
	execAll(t, db, `SELECT leash.resume_queue('kc')`)
	completeAll(t, db, claimedIDs(first))
	got := claimKeyed(t, db, "kc", 10, false)
	if len(got) != 1 || got[0].ConcurrencyKey != "" {
		t.Fatalf("claim once the cap had room took %v; want the job without a key", countKeys(got))
	}
	var wakes int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes WHERE queue = 'kc' AND key = ''`).Scan(&wakes); err != nil || wakes != 0 {
		t.Fatalf("%d wakes of jobs without a key left, %v; want none", wakes, err)
	}
}
