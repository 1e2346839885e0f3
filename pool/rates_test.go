package pool_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// mostStartsInWindow is the most starts (attempted_at, in the database) of queue's jobs in any
// half-open window of period beginning at or after from and ending by until: the most is reached
// by a window that begins at a start.
func mostStartsInWindow(t *testing.T, db *pgxpool.Pool, queue string, period time.Duration, from, until time.Time) int64 {
	t.Helper()
	return count(t, db, `
		SELECT coalesce(max((SELECT count(*) FROM leash.jobs b WHERE b.queue = $1 AND b.attempted_at >= a.attempted_at
		                       AND b.attempted_at < a.attempted_at + $2 * interval '1 microsecond')), 0)
		FROM leash.jobs a
		WHERE a.queue = $1 AND a.attempted_at >= $3 AND a.attempted_at + $2 * interval '1 microsecond' <= $4`,
		queue, period.Microseconds(), from, until)
}

// dbNow is the database clock, read after whatever the caller committed.
func dbNow(t *testing.T, db *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	if err := db.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// rateWorkers starts n pools of 20 slots on queues, their handlers taking a millisecond.
func rateWorkers(t *testing.T, db *pgxpool.Pool, n int, queues ...string) []*pool.Pool {
	t.Helper()
	var ps []*pool.Pool
	for range n {
		cfg := fastConfig()
		cfg.Queues = queues
		cfg.Concurrency = 20
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"rw": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			time.Sleep(time.Millisecond)
			return nil
		})})
		start(t, p)
		ps = append(ps, p)
	}
	return ps
}

// A rate limit holds across four pools that together could start far more: in no window of the
// period, sampled from the starts the database recorded, do more jobs start than the limit, and
// the queue drains at about the limit (it is reached).
func TestRateLimitAcrossPools(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const limit, jobs = 40, 400
	const period = 200 * time.Millisecond
	if err := pool.SetQueueRateLimit(ctx, db, "rated", limit, period); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT 'rated', 'rw' FROM generate_series(1, $1)`, jobs); err != nil {
		t.Fatal(err)
	}
	ps := rateWorkers(t, db, 4, "rated")
	waitFor(t, 60*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == jobs
	})
	var limited int64
	for _, p := range ps {
		limited += p.Stats().RateLimited
	}
	if limited < jobs/limit-1 {
		t.Errorf("Stats.RateLimited: %d claims found the queue at its limit; want one per period at least", limited)
	}
	far := time.Now().Add(time.Hour)
	if m := mostStartsInWindow(t, db, "rated", period, time.Time{}, far); m > limit {
		t.Fatalf("%d starts in one window of %s; the limit is %d", m, period, limit)
	} else if m < limit {
		t.Fatalf("at most %d starts in a window of %s: the limit %d was never reached", m, period, limit)
	}
	var span float64
	if err := db.QueryRow(ctx, `SELECT extract(epoch FROM max(attempted_at) - min(attempted_at)) FROM leash.jobs`).Scan(&span); err != nil {
		t.Fatal(err)
	}
	// 400 starts at 40 per 200ms take at least 1.8s (the first 40 at once); well under twice that.
	if min, most := float64(jobs/limit-1)*period.Seconds(), 2*float64(jobs/limit)*period.Seconds(); span < min-0.01 || span > most {
		t.Fatalf("the starts spanned %.2fs; want %.1fs to %.1fs", span, min, most)
	}
}

// A rate limit changed under load binds every worker from its commit: every window of the
// period that begins after a change (and ends before the next) holds at most the limit then set;
// a raised limit is used; removed, the queue drains as any other. The limit is first set on a
// queue the pools already work unlimited.
func TestRateLimitChangedUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const period = 100 * time.Millisecond
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT 'rated', 'rw' FROM generate_series(1, 3000)`); err != nil {
		t.Fatal(err)
	}
	rateWorkers(t, db, 4, "rated")
	waitFor(t, 20*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) >= 100
	})
	// Each limit's windows begin after its commit (read after it) and end before the next change
	// (read before it began).
	type change struct {
		limit         int
		before, after time.Time
	}
	var changes []change
	for _, limit := range []int{20, 5, 30} {
		before := dbNow(t, db)
		if err := pool.SetQueueRateLimit(ctx, db, "rated", limit, period); err != nil {
			t.Fatal(err)
		}
		changes = append(changes, change{limit, before, dbNow(t, db)})
		started := count(t, db, `SELECT count(*) FROM leash.jobs WHERE attempted_at IS NOT NULL`)
		// Let each limit run for several periods of starts.
		waitFor(t, 20*time.Second, func() bool {
			return count(t, db, `SELECT count(*) FROM leash.jobs WHERE attempted_at IS NOT NULL`) >= started+int64(4*limit)
		})
	}
	before := dbNow(t, db)
	if err := pool.SetQueueRateLimit(ctx, db, "rated", -1, 0); err != nil {
		t.Fatal(err)
	}
	changes = append(changes, change{-1, before, dbNow(t, db)})
	waitFor(t, 60*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 3000
	})
	for i, c := range changes[:len(changes)-1] {
		m := mostStartsInWindow(t, db, "rated", period, c.after, changes[i+1].before)
		if m > int64(c.limit) {
			t.Fatalf("limit %d: %d starts in one window of %s after its commit", c.limit, m, period)
		}
		if m < int64(c.limit) {
			t.Errorf("limit %d: at most %d starts in a window of %s: never reached", c.limit, m, period)
		}
	}
}

// A transaction holding a rate-limited queue's row (an operator's forgotten BEGIN; UPDATE)
// stops that queue alone: the same pools go on starting another queue's jobs, and the queue
// starts once the transaction ends.
func TestRateLimitRowHeldStopsOnlyItsQueue(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueRateLimit(ctx, db, "rated", 1000, time.Second); err != nil {
		t.Fatal(err)
	}
	rateWorkers(t, db, 2, "rated", "free")
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = forgotten.Rollback(context.Background()) })
	if _, err := forgotten.Exec(ctx, `UPDATE leash.queues SET rate_limit = 5 WHERE name = 'rated'`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT q, 'rw' FROM unnest(ARRAY['rated', 'free']) q, generate_series(1, 200)`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'free' AND state = 'completed'`) == 200
	})
	if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'rated' AND attempted_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d jobs of the queue whose row is held started", n)
	}
	if err := forgotten.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'rated' AND state = 'completed'`) == 200
	})
}

// Roles holding exactly docs/sql.md's grants work rate limits: an operator sets the limit and a
// worker claims under it.
func TestRateLimitWithDocsGrants(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	operator := poolAsRole(t, db, readmeGrants(t, "leash_operator", "%s")...)
	if _, err := operator.Exec(ctx, `SELECT leash.set_queue_rate_limit('gq', 5, interval '100 milliseconds')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT 'gq', 'rw' FROM generate_series(1, 20)`); err != nil {
		t.Fatal(err)
	}
	worker := poolAsRole(t, db, readmeGrants(t, "leash_worker", "%s")...)
	rateWorkers(t, worker, 1, "gq")
	waitFor(t, 20*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 20
	})
	if m := mostStartsInWindow(t, db, "gq", 100*time.Millisecond, time.Time{}, time.Now().Add(time.Hour)); m > 5 {
		t.Fatalf("%d starts in one window; the limit is 5", m)
	}
}

// A per-key rate limit holds across four pools that together could start far more: for each key,
// no window of the period holds more starts than the limit, sampled both in the handlers (every
// attempt, as it starts) and from the starts the database recorded; the limit is reached, jobs
// without a key run beside it unlimited, and the keys drain at about the limit.
func TestKeyRateLimitAcrossPools(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const limit, keys, perKey = 3, 5, 24
	const period = 200 * time.Millisecond
	if err := pool.SetQueueKeyRateLimit(ctx, db, "krated", limit, period); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key)
		SELECT 'krated', 'kr', 'k' || (i % $1) FROM generate_series(1, $2) i`, keys, keys*perKey); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT 'krated', 'kr' FROM generate_series(1, 100)`); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]time.Time{}
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"krated"}
		cfg.Concurrency = 20
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"kr": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			mu.Lock()
			seen[j.ConcurrencyKey] = append(seen[j.ConcurrencyKey], j.AttemptedAt)
			mu.Unlock()
			time.Sleep(time.Millisecond)
			return nil
		})})
		start(t, p)
	}
	waitFor(t, 60*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == keys*perKey+100
	})
	most := func(starts []time.Time) int {
		slices.SortFunc(starts, func(a, b time.Time) int { return a.Compare(b) })
		best := 0
		for i := range starts {
			j, _ := slices.BinarySearchFunc(starts, starts[i].Add(period), func(a, b time.Time) int { return a.Compare(b) })
			best = max(best, j-i)
		}
		return best
	}
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		var fromDB []time.Time
		if err := db.QueryRow(ctx, `SELECT array_agg(attempted_at) FROM leash.jobs WHERE queue = 'krated' AND concurrency_key = $1`,
			key).Scan(&fromDB); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		inHandlers := slices.Clone(seen[key])
		mu.Unlock()
		if len(inHandlers) != perKey {
			t.Errorf("key %s: %d starts seen by the handlers; want %d", key, len(inHandlers), perKey)
		}
		for src, starts := range map[string][]time.Time{"the database": fromDB, "the handlers": inHandlers} {
			if m := most(starts); m > limit {
				t.Errorf("key %s: %d starts in one window of %s, as %s recorded them; the limit is %d", key, m, period, src, limit)
			} else if m < limit {
				t.Errorf("key %s: at most %d starts in a window of %s (%s): the limit %d was never reached", key, m, period, src, limit)
			}
		}
		// 24 starts at 3 per 200ms take at least 1.4s (the first 3 at once); well under twice that.
		slices.SortFunc(fromDB, func(a, b time.Time) int { return a.Compare(b) })
		span := fromDB[len(fromDB)-1].Sub(fromDB[0])
		if lo, hi := time.Duration(perKey/limit-1)*period, 2*time.Duration(perKey/limit)*period; span < lo-10*time.Millisecond || span > hi {
			t.Errorf("key %s: its starts spanned %s; want %s to %s", key, span, lo, hi)
		}
	}
	// Jobs without a key are not held back by the keys' rates.
	var unkeyedSpan float64
	if err := db.QueryRow(ctx, `SELECT extract(epoch FROM max(attempted_at) - min(attempted_at)) FROM leash.jobs
		WHERE queue = 'krated' AND concurrency_key IS NULL`).Scan(&unkeyedSpan); err != nil {
		t.Fatal(err)
	}
	if unkeyedSpan > 2 {
		t.Errorf("the 100 jobs without a key took %.2fs to start; the keys' rates should not hold them back", unkeyedSpan)
	}
}
