package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func execAll(t *testing.T, db *pgxpool.Pool, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		if _, err := db.Exec(context.Background(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}

func claimKeyed(t *testing.T, db *pgxpool.Pool, queue string, limit int, unkeyed bool) []store.ClaimedJob {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // a claim never waits
	defer cancel()
	jobs, _, err := store.ClaimKeyed(ctx, db, store.KeyedParams{Unkeyed: unkeyed,
		ClaimParams: store.ClaimParams{Queues: []string{queue}, Limit: limit, WorkerID: "w", Lease: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	return jobs
}

// settleKeyed claims nothing from queue (a claim of 0) until the sweep that follows a change of
// its limits has run (leash.key_sweeps): until then a claim may look at every key and at the jobs
// without a key once more.
func settleKeyed(t *testing.T, db *pgxpool.Pool, queue string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		claimKeyed(t, db, queue, 0, false)
		var left int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM leash.key_sweeps WHERE queue = $1`, queue).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			claimKeyed(t, db, queue, 0, false) // the wakes the sweep appended
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sweep of queue %s did not run within 10s", queue)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func claimedIDs(jobs []store.ClaimedJob) []int64 {
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	slices.Sort(ids)
	return ids
}

// A key's jobs start one after the other in its (priority, run_at, id) order with a per-key limit
// of 1; a job that waits to run again (a retry) holds its key, and runs before the key's next
// job; jobs without a key are not limited by the keys.
func TestClaimKeyedSequential(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		// ids 1..6: a a b b (b's second at priority -1, so first in b's order), then two without a key.
		`INSERT INTO leash.jobs (queue, kind, concurrency_key, priority) VALUES
		   ('kq', 'k', 'a', 0), ('kq', 'k', 'a', 0), ('kq', 'k', 'b', 0), ('kq', 'k', 'b', -1),
		   ('kq', 'k', NULL, 0), ('kq', 'k', NULL, 0)`)
	got := claimedIDs(claimKeyed(t, db, "kq", 10, true))
	if want := []int64{1, 4, 5, 6}; !slices.Equal(got, want) {
		t.Fatalf("first claim took %v; want %v", got, want)
	}
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 0 {
		t.Fatalf("second claim took %v; want nothing (each key is held)", claimedIDs(got))
	}
	// Job 1 fails and waits to retry: it holds a, so job 2 does not start.
	execAll(t, db, `UPDATE leash.jobs SET state = 'retryable', run_at = now() + interval '1 hour',
		lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id = 1`)
	if got := claimKeyed(t, db, "kq", 10, true); len(got) != 0 {
		t.Fatalf("claim took %v while job 1 waits to retry; want nothing", claimedIDs(got))
	}
	// Due again: job 1 runs again, before job 2.
	execAll(t, db, `UPDATE leash.jobs SET run_at = now() WHERE id = 1`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, true)); !slices.Equal(got, []int64{1}) {
		t.Fatalf("claim took %v; want job 1 again", got)
	}
	// Job 1 and job 4 complete: 2 and 3 start.
	execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id IN (1, 4)`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, true)); !slices.Equal(got, []int64{2, 3}) {
		t.Fatalf("claim took %v; want 2 and 3", got)
	}
	var rows, wakes int
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM leash.concurrency_keys), (SELECT count(*) FROM leash.key_wakes)`).Scan(&rows, &wakes); err != nil {
		t.Fatal(err)
	}
	if rows != 0 || wakes != 0 {
		t.Fatalf("%d key rows and %d wakes left; want none (nothing left to claim)", rows, wakes)
	}
}

// The claim of a queue with a per-key limit runs under READ COMMITTED whatever the session's
// default: its count of a key's holders must see the claims that committed before it took the
// queue's row. A test trigger records the isolation level of the claim's transaction.
func TestClaimKeyedIsReadCommitted(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`CREATE TABLE seen_isolation (level text)`,
		`CREATE FUNCTION record_isolation() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN INSERT INTO seen_isolation VALUES (current_setting('transaction_isolation')); RETURN NULL; END $$`,
		`CREATE TRIGGER record_isolation AFTER UPDATE ON leash.jobs FOR EACH STATEMENT EXECUTE FUNCTION record_isolation()`,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kq', 'w', 'k' || i FROM generate_series(1, 3) i`)
	cfg := db.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	rr, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer rr.Close()
	if got := claimKeyed(t, rr, "kq", 10, false); len(got) != 3 {
		t.Fatalf("ClaimKeyed = %d jobs; want 3", len(got))
	}
	var levels []string
	rows, err := db.Query(ctx, `SELECT DISTINCT level FROM seen_isolation`)
	if err == nil {
		for rows.Next() {
			var l string
			if err = rows.Scan(&l); err != nil {
				break
			}
			levels = append(levels, l)
		}
		rows.Close()
	}
	if err != nil || !slices.Equal(levels, []string{"read committed"}) {
		t.Fatalf("the claim ran under %v (%v); want read committed", levels, err)
	}
}

// Nothing another transaction holds makes the claim wait: a job row locked by a forgotten
// transaction (an operator's SELECT ... FOR UPDATE) costs its key alone, whose later jobs do not
// start in its place; a forgotten UPDATE of a running job of a key (whose trigger appended a wake)
// costs nothing; the queue's row held by a forgotten change costs that queue alone (the claim
// says it is busy at once), never another queue's claim.
func TestClaimKeyedNeverWaits(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		`SELECT leash.set_queue_max_running_per_key('other', 1)`,
		// ids 1, 2: key a; 3, 4: key b; 5: key c, running; 6: other queue.
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES
		   ('kq', 'w', 'a'), ('kq', 'w', 'a'), ('kq', 'w', 'b'), ('kq', 'w', 'b'), ('kq', 'w', 'c'), ('other', 'w', 'a')`,
		`UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 hour',
		   attempted_at = now() WHERE id = 5`)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	forgotten, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer forgotten.Rollback(context.Background())
	if _, err := forgotten.Exec(ctx, `SELECT FROM leash.jobs WHERE id = 1 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	if _, err := forgotten.Exec(ctx, `UPDATE leash.jobs SET state = 'cancelled', finished_at = now(),
		lease_token = NULL, lease_expires_at = NULL WHERE id = 5`); err != nil {
		t.Fatal(err)
	}
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, false)); !slices.Equal(got, []int64{3}) {
		t.Fatalf("claim took %v; want job 3 alone (job 1 locked, job 2 after it, c held by a running job)", got)
	}
	queueHeld, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer queueHeld.Rollback(context.Background())
	if _, err := queueHeld.Exec(ctx, `UPDATE leash.queues SET max_running = 10 WHERE name = 'kq'`); err != nil {
		t.Fatal(err)
	}
	_, _, err = store.ClaimKeyed(ctx, db, store.KeyedParams{ClaimParams: store.ClaimParams{
		Queues: []string{"kq"}, Limit: 10, WorkerID: "w", Lease: time.Minute}})
	if !errors.Is(err, store.ErrQueueBusy) {
		t.Fatalf("claim with the queue's row held: %v; want ErrQueueBusy", err)
	}
	if got := claimedIDs(claimKeyed(t, db, "other", 10, false)); !slices.Equal(got, []int64{6}) {
		t.Fatalf("claim of another queue took %v; want job 6", got)
	}
	if err := forgotten.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := queueHeld.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, false)); !slices.Equal(got, []int64{1}) {
		t.Fatalf("claim once the transactions ended took %v; want job 1", got)
	}
}

// Keys as any SQL client may write them: empty is refused (the Go API stores no key as NULL), a
// key over 1024 bytes is refused, NUL cannot be stored in text at all; a 1024-byte key of
// multibyte characters is a key like any other. A negative per-key limit is refused; 0 starts no
// job with a key, while the queue's jobs without one run.
func TestConcurrencyKeyBounds(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, bad := range []string{
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', '')`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', repeat('x', 1025))`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', repeat('é', 513))`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', e'a\x00b')`,
		`SELECT leash.set_queue_max_running_per_key('kq', -1)`,
		`INSERT INTO leash.queues (name, max_running_per_key) VALUES ('kq2', -3)`,
	} {
		if _, err := db.Exec(ctx, bad); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 0)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', repeat('é', 512)), ('kq', 'w', NULL)`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 10, true)); len(got) != 1 {
		t.Fatalf("claim with a limit of 0 took %v; want the job without a key alone", got)
	}
	execAll(t, db, `SELECT leash.set_queue_max_running_per_key('kq', 1)`)
	got := claimKeyed(t, db, "kq", 10, true)
	if len(got) != 1 || got[0].ConcurrencyKey != strings.Repeat("é", 512) {
		t.Fatalf("claim with a limit of 1 took %+v; want the job with the 1024-byte key", got)
	}
}

// A job without a key inserted into a queue with a per-key limit is claimed by the next claim,
// which looks for such jobs because of the insert (an entry of key ”), and by no claim after it
// that has no reason to look; queued again (a retry), it is claimed again.
func TestClaimKeyedFindsJobsWithoutKey(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db, `SELECT leash.set_queue_max_running_per_key('kq', 1)`)
	settleKeyed(t, db, "kq") // consumes the wakes of setting the limit, and its sweep
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind) VALUES ('kq', 'w'), ('kq', 'w')`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 1, false)); !slices.Equal(got, []int64{1}) {
		t.Fatalf("claim after the insert took %v; want job 1", got)
	}
	if got := claimKeyed(t, db, "kq", 1, false); len(got) != 0 {
		t.Fatalf("claim with no reason to look took %v; want nothing", claimedIDs(got))
	}
	if got := claimedIDs(claimKeyed(t, db, "kq", 1, true)); !slices.Equal(got, []int64{2}) {
		t.Fatalf("claim told to look took %v; want job 2", got)
	}
	execAll(t, db, `UPDATE leash.jobs SET state = 'retryable', lease_token = NULL, lease_expires_at = NULL WHERE id = 1`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 1, false)); !slices.Equal(got, []int64{1}) {
		t.Fatalf("claim after the retry took %v; want job 1", got)
	}
}

// explainedConn is a connection to url on which auto_explain sends the plan of every statement,
// those the claim's functions run included, to the client as a notice; plans returns them.
func explainedConn(t *testing.T, url string, analyze bool) (conn *pgx.Conn, plans func() []string) {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, n.Message)
	}
	conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	for _, sql := range []string{`LOAD 'auto_explain'`, `SET auto_explain.log_min_duration = 0`,
		`SET auto_explain.log_nested_statements = on`, `SET auto_explain.log_level = notice`,
		fmt.Sprintf(`SET auto_explain.log_analyze = %t`, analyze), fmt.Sprintf(`SET auto_explain.log_buffers = %t`, analyze),
		`SET auto_explain.log_timing = on`} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	return conn, func() []string {
		mu.Lock()
		defer mu.Unlock()
		out := got
		got = nil
		return out
	}
}

// Every statement of a keyed claim runs on its generic plan, made once per session
// (plan_cache_mode in the claim's functions), and that plan must reach every job through the
// indexes of its key or, once chosen, by its ctid, and the keys through their tables' indexes: a
// plan that scans the queue's claim index for a key's jobs walks the queue's whole backlog at
// every claim. Only the look for jobs without a key (alias u) walks the claim index. The plans
// are the ones the claims ran (auto_explain), made before any ANALYZE: a fresh install, a table
// autovacuum has not reached, must be as good.
func TestClaimKeyedGenericPlans(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	execAll(t, db,
		`ALTER TABLE leash.jobs SET (autovacuum_enabled = false)`,
		`ALTER TABLE leash.concurrency_keys SET (autovacuum_enabled = false)`,
		`ALTER TABLE leash.key_wakes SET (autovacuum_enabled = false)`,
		`SELECT leash.set_queue_max_running_per_key('kq', 2)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kq', 'w', 'k' || (i % 500) FROM generate_series(1, 5000) i`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'other', 'w' FROM generate_series(1, 5000) i`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'kq', 'w' FROM generate_series(1, 50) i`)
	conn, plans := explainedConn(t, url, false)
	ctx := context.Background()
	claim := func(unkeyed bool) {
		if _, _, err := store.ClaimKeyed(ctx, conn, store.KeyedParams{Unkeyed: unkeyed,
			ClaimParams: store.ClaimParams{Queues: []string{"kq"}, Limit: 10, WorkerID: "w", Lease: time.Minute}}); err != nil {
			t.Fatal(err)
		}
	}
	for range 8 { // the plan cache makes the generic plans at the first executions
		claim(false)
	}
	plans()
	claim(true)
	execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE state = 'running' AND concurrency_key IS NOT NULL`)
	claim(false) // the completions' wakes
	got := plans()
	if len(got) < 10 {
		t.Fatalf("auto_explain logged %d plans", len(got))
	}
	for _, plan := range got {
		for _, l := range strings.Split(plan, "\n") {
			bad := strings.Contains(l, "Seq Scan on jobs") || strings.Contains(l, "Seq Scan on concurrency_keys") ||
				strings.Contains(l, "Seq Scan on key_wakes") || strings.Contains(l, "Bitmap Heap Scan on key_wakes") ||
				(strings.Contains(l, "jobs_claimable_idx") && !strings.Contains(l+" ", " on jobs u "))
			if bad {
				t.Errorf("a plan of the claim walks a table: %s\n%s", strings.TrimSpace(l), plan)
			}
		}
	}
}

// Keys take turns: a key whose jobs keep finishing does not keep a slot to itself while another
// key waits. Key a has a backlog and a limit of 5, all held; b's first job is inserted after a's
// jobs started. Each time one of a's jobs finishes, a claim of one job runs: b's job starts at the
// second such claim at the latest (the first may go to a, whose jobs started before b's insert).
func TestClaimKeyedKeysTakeTurns(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 5)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kq', 'w', 'a' FROM generate_series(1, 2000)`)
	if got := claimKeyed(t, db, "kq", 10, false); len(got) != 5 {
		t.Fatalf("first claim took %d jobs of a; want 5", len(got))
	}
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', 'b')`)
	for round := 1; ; round++ {
		execAll(t, db, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL, leased_by = NULL,
			lease_expires_at = NULL WHERE id = (SELECT min(id) FROM leash.jobs WHERE state = 'running')`)
		got := claimKeyed(t, db, "kq", 1, false)
		if len(got) != 1 {
			t.Fatalf("claim %d took %d jobs; want 1", round, len(got))
		}
		if got[0].ConcurrencyKey == "b" {
			return
		}
		if round == 2 {
			t.Fatalf("b's job did not start in %d claims while a's jobs kept finishing", round)
		}
	}
}

// A key the claim took a job of keeps its place while it has room, or a job that holds it waits to
// run again: the claim brings the keys it walked up to date itself (no trigger wakes a key for a
// claim), reading their jobs again unless the key is at its limit with no holder waiting.
func TestClaimKeyedKeepsKeysWithRoom(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 2)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'kq', 'w', 'k' FROM generate_series(1, 3)`)
	for i, want := range [][]int64{{1}, {2}, nil} {
		if got := claimedIDs(claimKeyed(t, db, "kq", 1, false)); !slices.Equal(got, want) {
			t.Fatalf("claim %d took %v; want %v", i+1, got, want)
		}
	}
	// At its limit, with one holder waiting to retry: the retry is the key's next.
	execAll(t, db, `UPDATE leash.jobs SET state = 'retryable', lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id = 1`)
	execAll(t, db, `INSERT INTO leash.jobs (queue, kind, concurrency_key) VALUES ('kq', 'w', 'k2')`)
	if got := claimedIDs(claimKeyed(t, db, "kq", 2, false)); !slices.Equal(got, []int64{1, 4}) {
		t.Fatalf("claim after the retry took %v; want [1 4]", got)
	}
}
