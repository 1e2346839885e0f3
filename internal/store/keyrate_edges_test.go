package store_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// startsOf returns the attempted_at of every started job of key of queue, oldest first.
func startsOf(t *testing.T, db *pgxpool.Pool, queue, key string) []time.Time {
	t.Helper()
	var starts []time.Time
	if err := db.QueryRow(context.Background(), `SELECT coalesce(array_agg(attempted_at ORDER BY attempted_at), '{}')
		FROM leash.jobs WHERE queue = $1 AND concurrency_key = $2 AND attempted_at IS NOT NULL`, queue, key).Scan(&starts); err != nil {
		t.Fatal(err)
	}
	return starts
}

// maxInWindow is the most starts any half-open window of period holds (a window that begins
// just before a start holds the starts in [s, s+period)).
func maxInWindow(starts []time.Time, period time.Duration) int {
	s := slices.Clone(starts)
	slices.SortFunc(s, func(a, b time.Time) int { return a.Compare(b) })
	best := 0
	for i := range s {
		n := 0
		for j := i; j < len(s) && s[j].Sub(s[i]) < period; j++ {
			n++
		}
		best = max(best, n)
	}
	return best
}

// A period the table's check compares as one day (a year is 360 days there) but that moves a
// timestamp back by four or five days: either the check refuses it, or the limit holds.
func TestKeyRatePeriodMixingYearsAndDays(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `SELECT leash.set_queue_key_rate_limit('kym', 1, interval '-1 year 361 days')`)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23514" {
		return // refused: fine
	}
	if err != nil {
		t.Fatal(err)
	}
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kym', 'w', 'a' FROM generate_series(1, 3)`)
	total := 0
	for range 3 {
		total += len(claimKeyed(t, db, "kym", 10, false))
	}
	if total > 1 {
		t.Fatalf("%d starts of key a within a second under a limit of 1 per '-1 year 361 days' (which the check "+
			"accepted as one day); want at most 1", total)
	}
}

// The same period on the queue's own rate limit (migration 025).
func TestRatePeriodMixingYearsAndDays(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `SELECT leash.set_queue_rate_limit('rym', 1, interval '-1 year 361 days')`)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23514" {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind) SELECT 'rym', 'w' FROM generate_series(1, 3)`)
	total := 0
	for range 3 {
		jobs, _, err := store.ClaimRated(ctx, db, store.ClaimParams{Queues: []string{"rym"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		total += len(jobs)
	}
	if total > 1 {
		t.Fatalf("%d starts within a second under a rate limit of 1 per '-1 year 361 days' (accepted as one day); want at most 1", total)
	}
}

// A producer whose transaction took its snapshot before the queue's first limit (a serializable
// or repeatable read transaction: a DBA's default_transaction_isolation) and inserts its job with
// a key only after the claims' sweep: its trigger saw no limit, the limit's look did not see the
// job, and the sweep ran before the producer had a transaction id. Its job must still be found.
func TestKeyRateLimitSetBesideSerializableProducer(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	producer, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Rollback(ctx)
	// The producer's first statement (its snapshot): it reads what it needs before inserting.
	if _, err := producer.Exec(ctx, `SELECT count(*) FROM leash.queues`); err != nil {
		t.Fatal(err)
	}
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('ksp', 5)`)
	deadline := time.Now().Add(10 * time.Second)
	for {
		claimKeyed(t, db, "ksp", 10, false)
		var left int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_sweeps WHERE queue = 'ksp'`).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the queue's sweep was not done in 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	var id int64
	if err := producer.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('ksp', 'w', 'late') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		got := claimedIDs(claimKeyed(t, db, "ksp", 10, false))
		if slices.Equal(got, []int64{id}) {
			return
		}
		if len(got) != 0 || time.Now().After(deadline) {
			t.Fatalf("claims for 5s after the producer committed took %v; want job %d (its key is unknown to the claims: "+
				"no row in leash.concurrency_keys, no wake, no sweep left)", got, id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Retention deletes a key's starts once they have left the window at its own clock, while a claim
// whose transaction began before that (its now(), its jobs' attempted_at) is about to take the
// queue's row: that claim counts the starts of its own window, which no longer includes the
// deleted one, and starts the key again within the period. Another worker's claim in between
// brings the key (woken by its job's completion) up to date without the deleted starts.
func TestDeleteIdleKeyRatesBesideClaim(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kdr', 1, interval '1 second')`,
		// ids 1, 2: key a; 3: key b, first in the claims' order.
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kdr', 'w', 'a'), ('kdr', 'w', 'a')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key, priority) VALUES ('kdr', 'w', 'b', -1)`)
	first := claimKeyed(t, db, "kdr", 2, false)
	if ids := claimedIDs(first); !slices.Equal(ids, []int64{1, 3}) {
		t.Fatalf("first claim took %v; want 1 and 3", ids)
	}
	// Job 1 completes (which wakes key a); job 3 goes back to wait for a retry (key b is first again).
	execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = 1`,
		`UPDATE leash.jobs SET state = 'retryable', run_at = now() - interval '1 hour', lease_token = NULL, lease_expires_at = NULL WHERE id = 3`)
	time.Sleep(500 * time.Millisecond)
	// A claim's transaction begins half a period after job 1's start, and is delayed before it takes
	// the queue's row (a descheduled backend: the batch's BEGIN and row lock are two statements).
	late, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if _, err := late.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(700 * time.Millisecond)
	// Retention: at its clock, job 1's start has left the window (by less than a minute: it keeps
	// the row).
	if _, err := store.DeleteIdleKeyRates(ctx, db, 100); err != nil {
		t.Fatal(err)
	}
	// Another worker's claim: it brings key a up to date (no starts left), takes key b's job.
	if ids := claimedIDs(claimKeyed(t, db, "kdr", 1, false)); !slices.Equal(ids, []int64{3}) {
		t.Fatalf("the other worker's claim took %v; want job 3", ids)
	}
	// The delayed claim goes on.
	mark := strconv.FormatUint(rand.Uint64(), 36)
	if _, err := late.Exec(ctx, store.LockQueueRowSQL, "kdr", mark); err != nil {
		t.Fatal(err)
	}
	rows, err := late.Query(ctx, store.ClaimKeyedSQL, "kdr", 10, "w2", int64(60000), mark, false)
	if err != nil {
		t.Fatal(err)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var ms *float64
	if err := late.QueryRow(ctx, store.ClaimKeyedDoneSQL, "kdr", mark).Scan(&ms); err != nil {
		t.Fatal(err)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	starts := startsOf(t, db, "kdr", "a")
	if n := maxInWindow(starts, time.Second); n > 1 {
		t.Fatalf("key a started at %v: %d starts in a window of 1s under a limit of 1", starts, n)
	}
}

// refusedOrDone runs sql and reports whether the table's check refused it; any other error fails.
func refusedOrDone(t *testing.T, db *pgxpool.Pool, sql string) bool {
	t.Helper()
	_, err := db.Exec(context.Background(), sql)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23514" {
		return true
	}
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return false
}

// A row of leash.key_rates written by hand with a NULL start (which would sort first, newest
// first, and push out the starts the claims record): refused by the table's check, or the limit
// holds.
func TestKeyRatesNullStart(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kn', 1, interval '1 hour')`)
	for _, bad := range []string{
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kn', 'a', ARRAY[NULL]::timestamptz[])`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kn', 'a', ARRAY[now(), NULL])`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kn', 'a', ARRAY[[now()]])`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kn', 'a', '[0:0]={"2026-01-01"}')`,
	} {
		if !refusedOrDone(t, db, bad) {
			t.Errorf("%s: accepted; want the check to refuse it", bad)
			execAll(t, db, `DELETE FROM leash.key_rates`)
		}
	}
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kn', 'w', 'a' FROM generate_series(1, 3)`)
	total := 0
	for range 3 {
		total += len(claimKeyed(t, db, "kn", 10, false))
	}
	if total > 1 {
		t.Fatalf("%d starts of key a in a second under 1 per hour (its row of leash.key_rates began as {NULL}); want 1", total)
	}
}

// A row of leash.key_rates written by hand out of order (oldest first), which would place the key
// due while it has no room (every claim would walk it, and with a claim's room of one hold back
// every key behind it): refused by the table's check; written newest first, the key waits.
func TestKeyRatesUnsortedStartsHoldBackOtherKeys(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db, `SELECT leash.set_queue_key_rate_limit('kus', 1, interval '1 hour')`)
	if !refusedOrDone(t, db, `INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kus', 'a', ARRAY[now() - interval '2 hours', now() - interval '1 minute'])`) {
		t.Error("starts oldest first accepted; want the check to refuse them")
		execAll(t, db, `DELETE FROM leash.key_rates`)
	}
	execAll(t, db,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kus', 'a', ARRAY[now() - interval '1 minute', now() - interval '2 hours'])`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kus', 'w', 'a')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kus', 'w', 'b')`)
	var got []int64
	for range 3 {
		got = append(got, claimedIDs(claimKeyed(t, db, "kus", 1, false))...)
	}
	if !slices.Equal(got, []int64{2}) {
		t.Fatalf("three claims of one job took %v; want key b's job 2 (key a has no room)", got)
	}
}

// One row of leash.key_rates whose start is near the largest timestamp: retention, which runs
// before every other deletion of a worker's pass, fails for every queue.
func TestDeleteIdleKeyRatesOutOfRangeStart(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kor', 1, interval '1 hour')`,
		`SELECT leash.set_queue_key_rate_limit('kor2', 1, interval '1 minute')`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kor', 'far', ARRAY['294276-12-31 23:00:00+00'::timestamptz])`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kor2', 'idle', ARRAY[now() - interval '2 hours'])`)
	n, err := store.DeleteIdleKeyRates(ctx, db, 100)
	if err != nil {
		t.Fatalf("retention with one odd row: %v; want the idle row of another queue deleted", err)
	}
	if n != 1 {
		t.Fatalf("retention deleted %d; want 1", n)
	}
}

// 30 claimers of one queue at once, jobs completing and retrying: every window of every key, from
// the attempted_at the claims returned (every attempt), holds at most the limit. (Held.)
func TestKeyRateManyClaimers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 32 // a connection for each claimer
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	const period = 200 * time.Millisecond
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kmc', 2, interval '200 milliseconds')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kmc', 'w', 'k' || (i % 5) FROM generate_series(1, 400) i`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'kmc', 'w' FROM generate_series(1, 50)`)
	var mu sync.Mutex
	starts := map[string][]time.Time{}
	// The claimers run for at least 1.5s and on until enough windows have passed that every key
	// had a few starts, so a loaded machine (slow claims) still sees the limit under contention;
	// the deadline only bounds a queue that never gives out a keyed job.
	const wantStarts = 5 * 2 * 3
	minStop, deadline := time.Now().Add(1500*time.Millisecond), time.Now().Add(30*time.Second)
	running := func() bool {
		now := time.Now()
		if now.Before(minStop) {
			return true
		}
		mu.Lock()
		n := 0
		for _, s := range starts {
			n += len(s)
		}
		mu.Unlock()
		return n < wantStarts && now.Before(deadline)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 30)
	for w := range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for running() {
				jobs, _, err := store.ClaimKeyed(ctx, db, store.KeyedParams{Unkeyed: w%3 == 0,
					ClaimParams: store.ClaimParams{Queues: []string{"kmc"}, Limit: 3, WorkerID: fmt.Sprint("w", w), Lease: time.Minute}})
				if errors.Is(err, store.ErrQueueBusy) {
					time.Sleep(5 * time.Millisecond)
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				for i, j := range jobs {
					if j.ConcurrencyKey == "" {
						continue
					}
					mu.Lock()
					starts[j.ConcurrencyKey] = append(starts[j.ConcurrencyKey], j.AttemptedAt)
					mu.Unlock()
					// Every other job retries at once (a start again), the others complete.
					sql := `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`
					if i%2 == 0 {
						sql = `UPDATE leash.jobs SET state = 'retryable', run_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`
					}
					if _, err := db.Exec(ctx, sql, j.ID); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	total := 0
	for k, s := range starts {
		total += len(s)
		if n := maxInWindow(s, period); n > 2 {
			t.Errorf("key %s: %d starts in a window of %s; want at most 2", k, n, period)
		}
	}
	if total < wantStarts {
		t.Errorf("only %d starts of keyed jobs in 30s; want at least %d (three windows' worth per key)", total, wantStarts)
	}
	t.Logf("%d keyed starts", total)
}

// The admin read of a key whose row of leash.key_rates holds a start at infinity (a key that has
// no room until then): it reads as out of room, never as an error for the whole queue.
func TestReadKeyUseInfiniteStart(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_key_rate_limit('kiu', 1, interval '1 hour')`,
		`INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kiu', 'a', ARRAY['infinity'::timestamptz])`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kiu', 'w', 'a'), ('kiu', 'w', 'b')`)
	uses, err := store.ReadKeyUse(ctx, db, "kiu", 100, 1000)
	if err != nil {
		t.Fatalf("read the keys of a queue with one start at infinity: %v", err)
	}
	for _, u := range uses {
		if u.Key == "a" && !u.OutOfRate {
			t.Errorf("key a reads as %+v; want out of room", u)
		}
	}
}

// The per-key rate limit and its period changed again and again while 8 claimers run: every
// window that lies wholly between two changes holds at most the limit set at the first of them.
// (Held.)
func TestKeyRateChangedWhileClaiming(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 12
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	type setting struct {
		n      int
		period time.Duration
	}
	settings := []setting{{2, 300 * time.Millisecond}, {1, 300 * time.Millisecond}, {3, 300 * time.Millisecond},
		{1, 600 * time.Millisecond}, {2, 150 * time.Millisecond}, {0, time.Second}, {2, 300 * time.Millisecond}}
	type change struct {
		from, to time.Time // as the database's clock has them: after its commit, before the next
		setting
	}
	var changes []change
	setAt := func(s setting) time.Time {
		if _, err := store.SetQueueKeyRateLimit(ctx, db, "kcw", &s.n, s.period); err != nil {
			t.Fatal(err)
		}
		var now time.Time
		if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	from := setAt(settings[0])
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kcw', 'w', 'k' || (i % 4) FROM generate_series(1, 600) i`)
	var mu sync.Mutex
	starts := map[string][]time.Time{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				jobs, _, err := store.ClaimKeyed(ctx, db, store.KeyedParams{
					ClaimParams: store.ClaimParams{Queues: []string{"kcw"}, Limit: 4, WorkerID: fmt.Sprint("w", w), Lease: time.Minute}})
				if errors.Is(err, store.ErrQueueBusy) {
					time.Sleep(3 * time.Millisecond)
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				for i, j := range jobs {
					mu.Lock()
					starts[j.ConcurrencyKey] = append(starts[j.ConcurrencyKey], j.AttemptedAt)
					mu.Unlock()
					sql := `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`
					if i%2 == 0 {
						sql = `UPDATE leash.jobs SET state = 'retryable', run_at = now(), lease_token = NULL, lease_expires_at = NULL WHERE id = $1`
					}
					if _, err := db.Exec(ctx, sql, j.ID); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	for i := 1; i <= len(settings); i++ {
		time.Sleep(450 * time.Millisecond)
		var before time.Time
		if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
			t.Fatal(err)
		}
		changes = append(changes, change{from, before, settings[i-1]})
		if i < len(settings) {
			from = setAt(settings[i])
		}
	}
	close(done)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	total := 0
	for k, s := range starts {
		total += len(s)
		slices.SortFunc(s, func(a, b time.Time) int { return a.Compare(b) })
		for _, c := range changes {
			for i := range s {
				if !s[i].After(c.from) || s[i].Add(c.period).After(c.to) {
					continue
				}
				n := 0
				for j := i; j < len(s) && s[j].Sub(s[i]) < c.period; j++ {
					n++
				}
				if n > c.n {
					t.Errorf("key %s: %d starts from %s within %s, between the changes at %s and %s (limit %d)",
						k, n, s[i].Format("15:04:05.000000"), c.period, c.from.Format("15:04:05.000"), c.to.Format("15:04:05.000"), c.n)
				}
			}
		}
	}
	t.Logf("%d starts", total)
}

// What a claim of 100 keys costs under the largest per-key rate limit, with each key's row full
// (999 starts in the window: room for one more), against the same claim under a limit of 10 (9
// starts each): the claim reads at most its room of each walked key's starts, and appends the new
// ones without sorting. A measurement (LEASH_MEASURE=1), not a check: times vary with the machine.
func TestKeyRateFullRowsClaimCost(t *testing.T) {
	if os.Getenv("LEASH_MEASURE") == "" {
		t.Skip("set LEASH_MEASURE=1 to measure a claim under full rows of leash.key_rates")
	}
	db := pgtest.Pool(t)
	claimCost := func(queue string, limit int) time.Duration {
		execAll(t, db,
			fmt.Sprintf(`SELECT leash.set_queue_key_rate_limit('%s', %d, interval '31 days')`, queue, limit),
			fmt.Sprintf(`INSERT INTO leash.key_rates (queue, key, starts)
			 SELECT '%s', 'k' || k, ARRAY(SELECT now() - interval '1 day' - i * interval '1 second' FROM generate_series(1, %d) i)
			 FROM generate_series(1, 100) k`, queue, limit-1),
			fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT '%s', 'w', 'k' || (i %% 100 + 1) FROM generate_series(1, 300) i`, queue))
		if got := claimKeyed(t, db, queue, 1, false); len(got) != 1 { // wakes the keys
			t.Fatalf("first claim of %s took %d", queue, len(got))
		}
		began := time.Now()
		if got := claimKeyed(t, db, queue, 100, false); len(got) != 99 {
			t.Fatalf("claim of %s took %d; want 99", queue, len(got))
		}
		return time.Since(began)
	}
	small := claimCost("kfs", 10)
	full := claimCost("kff", 1000)
	t.Logf("claim of 99 keys: %s under a limit of 10, %s under 1,000 with full rows", small, full)
}
