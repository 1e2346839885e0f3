package pool_test

// Flow control against hostile input: keys no job may carry, a batch with one of them, and
// sessions holding what the claims of a queue with a per-key limit read or write.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// An InsertMany batch with one key no job may carry (NUL, invalid UTF-8, over 1024 bytes) fails
// whole, naming the key's fault and the job's place in the batch, before the database: nothing
// of the batch is inserted. From SQL the same keys fail the whole statement, naming the check.
func TestConcurrencyKeyBadInBatch(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, "bq", 1); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"a\x00b", "bad\xff", strings.Repeat("k", pool.MaxConcurrencyKeyBytes+1)} {
		batch := make([]pool.InsertManyParams, 6)
		for i := range batch {
			batch[i] = pool.InsertManyParams{Kind: "k", Opts: &pool.InsertOpts{Queue: "bq", ConcurrencyKey: fmt.Sprint("key-", i%2)}}
		}
		batch[3].Opts = &pool.InsertOpts{Queue: "bq", ConcurrencyKey: bad}
		_, err := pool.InsertMany(ctx, db, batch)
		if !errors.Is(err, pool.ErrInvalidJob) {
			t.Fatalf("InsertMany, key %q: %v; want ErrInvalidJob", bad[:min(len(bad), 8)], err)
		}
		if msg := err.Error(); !strings.Contains(msg, "concurrency key") || !strings.Contains(msg, "job 3:") {
			t.Errorf("InsertMany, key %q: %q names neither the concurrency key nor the job", bad[:min(len(bad), 8)], msg)
		}
	}
	if n := count(t, db, `SELECT count(*) FROM leash.jobs`); n != 0 {
		t.Fatalf("%d jobs of the refused batches were inserted", n)
	}
	for _, sql := range []string{
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('bq', 'k', 'a'), ('bq', 'k', repeat('x', 1025)), ('bq', 'k', 'b')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('bq', 'k', 'a'), ('bq', 'k', '')`,
	} {
		_, err := db.Exec(ctx, sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.ConstraintName != "jobs_concurrency_key_check" {
			t.Errorf("%s: %v; want a violation of jobs_concurrency_key_check", sql, err)
		}
	}
	_, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('bq', 'k', 'a'), ('bq', 'k', e'a\x00b')`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "22021" { // character_not_in_repertoire
		t.Errorf("a key holding NUL from SQL: %v; want invalid byte sequence", err)
	}
	if n := count(t, db, `SELECT count(*) FROM leash.jobs`); n != 0 {
		t.Fatalf("%d jobs of the refused statements were inserted", n)
	}
	if n := count(t, db, `SELECT count(*) FROM leash.key_wakes WHERE key <> ''`); n != 0 {
		t.Fatalf("the refused inserts left %d wakes", n)
	}
}

// flowWorkers starts n pools of queues whose handlers take a millisecond.
func flowWorkers(t *testing.T, db *pgxpool.Pool, n int, queues ...string) {
	t.Helper()
	for range n {
		cfg := fastConfig()
		cfg.Queues = queues
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"fw": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			time.Sleep(time.Millisecond)
			return nil
		})})
		start(t, p)
	}
}

// insertFlow inserts n jobs of kind fw into each queue, keyed over four keys.
func insertFlow(t *testing.T, db *pgxpool.Pool, n int, queues ...string) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.jobs (queue, kind, concurrency_key)
		SELECT q, 'fw', 'key-' || (i % 4) FROM unnest($1::text[]) q, generate_series(1, $2) i`, queues, n); err != nil {
		t.Fatal(err)
	}
}

// completed is how many of queue's jobs completed.
func completed(t *testing.T, db *pgxpool.Pool, queue string) int64 {
	t.Helper()
	return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = $1 AND state = 'completed'`, queue)
}

// A transaction holding the row of a queue with a per-key limit (an operator's forgotten
// BEGIN; UPDATE) stops that queue alone: the same pools go on with another queue with a per-key
// limit and with an unlimited one, and the queue starts once the transaction ends.
func TestKeyedQueueRowHeldStopsOnlyItsQueue(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, q := range []string{"held", "other"} {
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, q, 2); err != nil {
			t.Fatal(err)
		}
	}
	flowWorkers(t, db, 2, "held", "other", "free")
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = forgotten.Rollback(context.Background()) })
	if _, err := forgotten.Exec(ctx, `UPDATE leash.queues SET max_running = 50 WHERE name = 'held'`); err != nil {
		t.Fatal(err)
	}
	insertFlow(t, db, 100, "held", "other", "free")
	waitFor(t, 20*time.Second, func() bool { return completed(t, db, "other")+completed(t, db, "free") == 200 })
	if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'held' AND attempted_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d jobs of the queue whose row is held started", n)
	}
	if err := forgotten.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return completed(t, db, "held") == 100 })
}

// allAdvisoryLocks takes every advisory lock leash uses or an earlier release waited for: a
// capped queue's claim key for each queue, the waiting hint's, the planner statistics', the
// minute sampler's and the migrations'.
func allAdvisoryLocks(queues ...string) string {
	var b strings.Builder
	b.WriteString(`SELECT pg_advisory_lock(30510766707210100), pg_advisory_lock(30510766707204462),
		pg_advisory_lock(x'6c656173687374'::bigint), pg_advisory_lock(x'6c65617368'::bigint)`)
	for _, q := range queues {
		fmt.Fprintf(&b, ", pg_advisory_lock(1818583411, hashtext('%s'))", q)
	}
	return b.String()
}

// A session holding rows of leash.concurrency_keys or leash.key_wakes of a queue with a per-key
// limit (an operator's forgotten SELECT ... FOR KEY SHARE, or FOR UPDATE), beside a role without
// grants that holds every advisory lock leash uses and is refused those rows, stops at most that
// queue: the same pools go on with another queue with a per-key limit and with an unlimited one
// without waiting, and the queue drains once the session's transaction ends.
func TestKeyRowsHeldStopOnlyTheirQueue(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ table, lock string }{
		{"concurrency_keys", "key share"}, {"concurrency_keys", "update"}, {"key_wakes", "key share"},
	} {
		t.Run(tc.table+"_"+strings.ReplaceAll(tc.lock, " ", "_"), func(t *testing.T) {
			t.Parallel()
			keyRowsHeld(t, tc.table, tc.lock)
		})
	}
}

func keyRowsHeld(t *testing.T, table, lock string) {
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, q := range []string{"held", "other"} {
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, q, 1); err != nil {
			t.Fatal(err)
		}
	}
	stranger := strangerSession(t, db)
	if _, err := stranger.Exec(ctx, allAdvisoryLocks("held", "other", "free", "default")); err != nil {
		t.Fatalf("a role without grants takes the advisory locks: %v", err)
	}
	for _, sql := range []string{`SELECT FROM leash.concurrency_keys FOR KEY SHARE`, `SELECT FROM leash.key_wakes FOR KEY SHARE`} {
		_, err := stranger.Exec(ctx, sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42501" {
			t.Fatalf("a role without grants ran %s: %v (want insufficient_privilege)", sql, err)
		}
	}
	// A job of each of four keys of queue held, due in a moment: the queue's keys have their rows
	// (at those jobs) once a claim has seen their wakes, and the claims that start them write
	// those rows again.
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key, run_at)
		SELECT 'held', 'fw', 'key-' || i, now() + interval '1500 milliseconds' FROM generate_series(0, 3) i`); err != nil {
		t.Fatal(err)
	}
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = forgotten.Rollback(context.Background()) })
	lockRows := func() {
		t.Helper()
		if _, err := forgotten.Exec(ctx, `SELECT FROM leash.`+table+` WHERE queue = 'held' FOR `+lock); err != nil {
			t.Fatal(err)
		}
	}
	if table == "key_wakes" {
		lockRows() // the wakes of the inserts and of setting the limit, before any claim
	}
	// One pool: its claims of queue held are its only ones.
	flowWorkers(t, db, 1, "held", "other", "free")
	if table == "concurrency_keys" {
		waitFor(t, 10*time.Second, func() bool {
			return count(t, db, `SELECT count(*) FROM leash.concurrency_keys WHERE queue = 'held'`) == 4
		})
		lockRows()
	}
	insertFlow(t, db, 4, "held")
	// Once the held queue's first jobs are due, its claims meet the held rows.
	waitFor(t, 10*time.Second, func() bool { return count(t, db, `SELECT count(*) FROM leash.jobs WHERE run_at > now()`) == 0 })
	// Idle pools, one job at a time: each starts at once.
	for i := range 6 {
		q := []string{"free", "other"}[i%2]
		var id int64
		if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ($1, 'fw', 'k') RETURNING id`, q).Scan(&id); err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		for count(t, db, `SELECT count(*) FROM leash.jobs WHERE id = $1 AND state = 'completed'`, id) == 0 {
			if time.Since(began) > 5*time.Second { // seconds of margin for a loaded machine
				t.Fatalf("a job of queue %s inserted beside the held rows of queue held did not complete within %v (%d sessions wait on a lock)",
					q, time.Since(began).Round(time.Millisecond), count(t, db, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'`))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	var waiting []string
	db.QueryRow(ctx, `SELECT coalesce(array_agg(left(query, 120) || ' for ' || (clock_timestamp() - query_start)::text), '{}') FROM pg_stat_activity WHERE wait_event_type = 'Lock'`).Scan(&waiting)
	t.Logf("sessions waiting on a lock: %q", waiting)
	// Busy pools.
	insertFlow(t, db, 100, "other", "free")
	began := time.Now()
	waitFor(t, 30*time.Second, func() bool { return completed(t, db, "other")+completed(t, db, "free") == 206 })
	if took := time.Since(began); took > 9*time.Second {
		t.Fatalf("the other queues' 200 jobs took %v beside the held rows of queue held", took)
	}
	if err := forgotten.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return completed(t, db, "held") == 8 })
}

// strangerSession is a connection acting as a new role with USAGE on schema leash and no other
// grant.
func strangerSession(t *testing.T, db *pgxpool.Pool) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	role := fmt.Sprintf("stranger_%d", time.Now().UnixNano()%1e9)
	for _, sql := range []string{"CREATE ROLE " + role + " NOLOGIN", "GRANT USAGE ON SCHEMA leash TO " + role} {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, db.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close(context.Background())
		db.Exec(context.Background(), "DROP OWNED BY "+role)
		db.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	if _, err := conn.Exec(ctx, "SET ROLE "+role); err != nil {
		t.Fatal(err)
	}
	return conn
}
