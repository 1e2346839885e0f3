package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// notifications collects what a LISTEN connection receives, with a worker registered as waiting
// on the queues the tests use, up to a sentinel notification sent afterwards from the same
// session as the inserts (delivery follows commit order).
func notifications(t *testing.T, url string, do func(conn *pgx.Conn)) []string {
	t.Helper()
	ctx := context.Background()
	listener, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	if _, err := listener.Exec(ctx, "LISTEN job_available; LISTEN test_done"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// A worker waits on each of these queues: inserts notify only then.
	if err := store.RegisterWaiter(ctx, conn, "test", []string{"a", "b", "now", "full", "fine", "k", "default"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	do(conn)
	if _, err := conn.Exec(ctx, "NOTIFY test_done"); err != nil {
		t.Fatal(err)
	}
	var got []string
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("waiting for notifications: %v (got %v)", err, got)
		}
		if n.Channel == "test_done" {
			return got
		}
		got = append(got, n.Payload)
	}
}

func TestCopySendsOneNotificationPerQueue(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	got := notifications(t, url, func(conn *pgx.Conn) {
		ps := make([]store.InsertParams, 10000)
		for i := range ps {
			ps[i] = jp(store.InsertParams{Kind: "noop", Queue: []string{"a", "b"}[i%2]})
		}
		if n, err := store.InsertMany(context.Background(), conn, ps); err != nil || n != 10000 {
			t.Fatalf("copy: %d, %v", n, err)
		}
	})
	if len(got) != 2 || !(got[0] == "a" && got[1] == "b" || got[0] == "b" && got[1] == "a") {
		t.Fatalf("notifications %v, want one each for a and b", got)
	}
}

func TestScheduledInsertDoesNotNotify(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	got := notifications(t, url, func(conn *pgx.Conn) {
		ctx := context.Background()
		if _, err := store.Insert(ctx, conn, jp(store.InsertParams{Kind: "k", Delay: time.Hour})); err != nil {
			t.Fatal(err)
		}
		ps := []store.InsertParams{jp(store.InsertParams{Kind: "k", Delay: time.Hour}), jp(store.InsertParams{Kind: "k", Queue: "now"})}
		if _, err := store.InsertMany(ctx, conn, ps); err != nil {
			t.Fatal(err)
		}
	})
	if len(got) != 1 || got[0] != "now" {
		t.Fatalf("notifications %v, want only [now]", got)
	}
}

// fullQueueShim makes pg_notification_queue_usage() read shim.usage (a session setting; 0 when
// unset) in sessions whose search_path starts with schema shim and inside every function of
// schema leash (their search_path is pinned, so the shim goes
// into their own setting), in url's database only: the real queue cannot be filled in a test.
func fullQueueShim(t *testing.T, url string) {
	t.Helper()
	pgtest.Exec(t, url, `CREATE SCHEMA shim;
		CREATE FUNCTION shim.pg_notification_queue_usage() RETURNS double precision LANGUAGE sql
			AS $$ SELECT coalesce(nullif(current_setting('shim.usage', true), ''), '0')::float8 $$;
		DO $$
		DECLARE f regprocedure;
		BEGIN
			FOR f IN SELECT p.oid::regprocedure FROM pg_proc p WHERE p.pronamespace = 'leash'::regnamespace LOOP
				EXECUTE format('ALTER FUNCTION %s SET search_path = shim, pg_catalog, pg_temp', f);
			END LOOP;
		END $$`)
}

// The trigger skips NOTIFY when the notification queue is over half full.
func TestQueueUsageGuard(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := context.Background()
	fullQueueShim(t, url)
	got := notifications(t, url, func(conn *pgx.Conn) {
		if _, err := conn.Exec(ctx, "SET search_path = shim, pg_catalog, public; SET shim.usage = 0.9"); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Insert(ctx, conn, jp(store.InsertParams{Kind: "k", Queue: "full"})); err != nil {
			t.Fatalf("insert must not fail when the queue is full: %v", err)
		}
		if _, err := conn.Exec(ctx, "RESET search_path; RESET shim.usage"); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Insert(ctx, conn, jp(store.InsertParams{Kind: "k", Queue: "fine"})); err != nil {
			t.Fatal(err)
		}
	})
	if len(got) != 1 || got[0] != "fine" {
		t.Fatalf("notifications %v, want only [fine]", got)
	}
	var n int
	pgtest.PoolFor(t, url).QueryRow(ctx, "SELECT count(*) FROM leash.jobs").Scan(&n)
	if n != 2 {
		t.Fatalf("%d jobs, want 2", n)
	}
}

func TestMigrateTwiceAndConcurrently(t *testing.T) {
	t.Parallel()
	// A fresh, empty database: not the migrated template.
	url := pgtest.EmptyURL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	var wg sync.WaitGroup
	results := make([][]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() { defer wg.Done(); results[i], errs[i] = store.Migrate(ctx, db) }()
	}
	wg.Wait()
	applied := 0
	for i := range 4 {
		if errs[i] != nil {
			t.Fatalf("migrate %d: %v", i, errs[i])
		}
		applied += len(results[i])
	}
	all, _ := store.Migrations()
	if applied != len(all) {
		t.Fatalf("%d migrations applied across 4 concurrent runs, want %d", applied, len(all))
	}
	again, err := store.Migrate(ctx, db)
	if err != nil || len(again) != 0 {
		t.Fatalf("second run applied %v, %v", again, err)
	}
	var recorded int
	db.QueryRow(ctx, "SELECT count(*) FROM leash.schema_migrations").Scan(&recorded)
	if recorded != len(all) {
		t.Fatalf("%d versions recorded", recorded)
	}
}

func TestRevokeJob(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	queued, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k"}))
	running, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", Queue: "r"}))
	if _, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"r"}, Limit: 1, WorkerID: "w", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id   int64
		want bool
	}{{queued, true}, {running, true}, {999999, false}, {queued, false}} {
		if ok, err := store.Revoke(ctx, db, c.id, "why"); err != nil || ok != c.want {
			t.Fatalf("revoke %d = %v, %v; want %v", c.id, ok, err, c.want)
		}
	}
	var qs, rs string
	db.QueryRow(ctx, "SELECT state FROM leash.jobs WHERE id = $1", queued).Scan(&qs)
	db.QueryRow(ctx, "SELECT state FROM leash.jobs WHERE id = $1", running).Scan(&rs)
	if qs != "cancelled" || rs != "running" {
		t.Fatalf("queued %s, running %s", qs, rs)
	}
	// A plain UPDATE of revoked_at cancels a queued job just the same.
	other, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k"}))
	db.Exec(ctx, "UPDATE leash.jobs SET revoked_at = now() WHERE id = $1", other)
	db.QueryRow(ctx, "SELECT state FROM leash.jobs WHERE id = $1", other).Scan(&qs)
	if qs != "cancelled" {
		t.Fatalf("plain update left %s", qs)
	}
	if jobs, _ := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w", Lease: time.Minute}); len(jobs) != 0 {
		t.Fatalf("claimed revoked jobs %+v", jobs)
	}
}

// An operator role granted only leash.revoke_job can revoke jobs but not write the table.
func TestRevokeJobGrantedToOperatorOnly(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	id, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k"}))
	conn := connAsRole(t, db, "leash_operator",
		"GRANT USAGE ON SCHEMA leash TO %s",
		"GRANT EXECUTE ON FUNCTION leash.revoke_job(bigint, text) TO %s")
	var ok bool
	if err := conn.QueryRow(ctx, "SELECT leash.revoke_job($1, 'by operator')", id).Scan(&ok); err != nil || !ok {
		t.Fatalf("operator revoke: %v, %v", ok, err)
	}
	if _, err := conn.Exec(ctx, "UPDATE leash.jobs SET priority = 1"); err == nil {
		t.Fatal("operator could write the table")
	}
	// Everyone else is refused.
	other := connAsRole(t, db, "leash_operator_x", "GRANT USAGE ON SCHEMA leash TO %s")
	if _, err := other.Exec(ctx, "SELECT leash.revoke_job($1)", id); err == nil {
		t.Fatal("a role without the grant could revoke")
	}
}

// The rescuer's three outcomes: retryable, failed when attempts are used up, cancelled when the
// job was revoked; each guarded by the token it read.
func TestRescueOutcomes(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	retry, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", MaxAttempts: 5}))
	last, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", MaxAttempts: 1}))
	revoked, _ := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", MaxAttempts: 5}))
	if _, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 3, WorkerID: "w", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	db.Exec(ctx, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, revoked)
	if got, _ := store.Rescue(ctx, db, 10); len(got) != 0 {
		t.Fatalf("rescued unexpired leases: %+v", got)
	}
	db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'`)
	got, err := store.Rescue(ctx, db, 10)
	if err != nil || len(got) != 3 {
		t.Fatalf("rescue: %+v, %v", got, err)
	}
	want := map[int64]string{retry: "retryable", last: "failed", revoked: "cancelled"}
	for _, r := range got {
		if r.State != want[r.ID] || r.OldOwner != "w" || r.OldToken == 0 {
			t.Errorf("job %d rescued as %+v, want %s", r.ID, r, want[r.ID])
		}
	}
	var runnable bool
	db.QueryRow(ctx, `SELECT run_at <= now() AND lease_token IS NULL FROM leash.jobs WHERE id = $1`, retry).Scan(&runnable)
	if !runnable {
		t.Fatal("rescued job is not claimable at once")
	}
}

// Renewals and outcome writes on overlapping rows, with ids in opposite orders, must not deadlock:
// every multi-row write locks its rows in id order.
func TestMultiRowWritesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const n = 200
	for round := range 10 {
		ps := make([]store.InsertParams, n)
		for i := range ps {
			ps[i] = jp(store.InsertParams{Kind: "k", Queue: fmt.Sprintf("r%d", round)})
		}
		if _, err := store.InsertMany(ctx, db, ps); err != nil {
			t.Fatal(err)
		}
		jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{fmt.Sprintf("r%d", round)}, Limit: n, WorkerID: "w", Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		var up, down store.RenewParams
		outs := make([]store.Outcome, 0, n)
		for i := range jobs {
			j, r := jobs[i], jobs[len(jobs)-1-i]
			up.IDs, up.Tokens = append(up.IDs, j.ID), append(up.Tokens, j.Token)
			down.IDs, down.Tokens = append(down.IDs, r.ID), append(down.Tokens, r.Token)
			outs = append(outs, store.Outcome{ID: r.ID, Token: r.Token, State: store.StateCompleted})
		}
		up.Lease, down.Lease = time.Minute, time.Minute
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for _, f := range []func() error{
			func() error { _, err := store.Renew(ctx, db, up); return err },
			func() error { _, err := store.Renew(ctx, db, down); return err },
			func() error { _, err := store.Finish(ctx, db, outs); return err },
			func() error { _, err := store.Renew(ctx, db, up); return err },
		} {
			wg.Add(1)
			go func() { defer wg.Done(); errs <- f() }()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
	}
}

// A claim that starts past a cursor skips the jobs before it; LastClaimed finds the cursor of a
// claim's jobs whatever order they came back in.
func TestClaimAfterCursor(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	var ids []int64
	for _, prio := range []int16{0, 0, 0, 1} {
		id, err := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", Queue: "c", Priority: prio}))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	first, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"c"}, Limit: 1, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(first) != 1 || first[0].ID != ids[0] {
		t.Fatalf("first claim: %+v, %v", first, err)
	}
	// Put the first job back: a claim from the cursor must not see it, one from the front must.
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'available', lease_token = NULL, lease_expires_at = NULL WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	got, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"c"}, Limit: 10, WorkerID: "w", Lease: time.Minute,
		After: store.LastClaimed(first)})
	if err != nil || len(got) != 3 {
		t.Fatalf("claim after the cursor: %d jobs, %v; want 3", len(got), err)
	}
	for _, j := range got {
		if j.ID == ids[0] {
			t.Fatal("claim after the cursor took the job before it")
		}
	}
	if last := store.LastClaimed(got); last.ID != ids[3] || last.Priority != 1 {
		t.Fatalf("LastClaimed = %+v; want job %d", last, ids[3])
	}
	again, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"c"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(again) != 1 || again[0].ID != ids[0] {
		t.Fatalf("claim from the front: %+v, %v", again, err)
	}
}

// A claim past a cursor also takes, first, the jobs of the cursor's priority whose run_at lies
// within Lag before it (an insert that began before the last claimed job but committed after its
// claim), then those of the cursor's priority and run_at from RecheckFromID on (passed over by
// recent claims: locked then, or committed late with the same run_at); and not those further
// back, which wait for the next claim from the front.
func TestClaimAfterCursorWithLag(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	var t0 time.Time
	if err := db.QueryRow(ctx, `SELECT date_trunc('milliseconds', now()) - interval '1 minute'`).Scan(&t0); err != nil {
		t.Fatal(err)
	}
	insert := func(prio int16, runAt time.Time) int64 {
		t.Helper()
		var id int64
		if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, priority, run_at) VALUES ('lag', 'k', $1, $2) RETURNING id`,
			prio, runAt).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	passedLongAgo := insert(0, t0)                     // the cursor's run_at, before the recheck
	passedRecently := insert(0, t0)                    // the cursor's run_at, within the recheck
	cursorID := insert(0, t0)                          // the cursor itself
	lagged := insert(0, t0.Add(-50*time.Millisecond))  // within the lag
	tooOld := insert(0, t0.Add(-500*time.Millisecond)) // behind the lag
	higher := insert(-1, t0.Add(-10*time.Millisecond)) // another priority, ahead in claim order
	sameAfter := insert(0, t0)                         // the cursor's run_at, a larger id
	later := insert(0, t0.Add(time.Millisecond))       // past the cursor
	lowerPrio := insert(1, t0.Add(-time.Hour))         // a lower priority: past the cursor
	cursor := &store.ClaimCursor{Priority: 0, RunAt: t0, ID: cursorID}
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'running', lease_token = 1, lease_expires_at = now() + interval '1 minute' WHERE id = $1`, cursorID); err != nil {
		t.Fatal(err)
	}
	params := store.ClaimParams{Queues: []string{"lag"}, Limit: 3, WorkerID: "w", Lease: time.Minute,
		After: cursor, Lag: 100 * time.Millisecond, RecheckFromID: passedRecently}
	first, err := ensureAndClaim(ctx, db, params)
	if err != nil || len(first) != 3 {
		t.Fatalf("first claim: %d jobs, %v; want 3", len(first), err)
	}
	got := map[int64]bool{}
	for _, j := range first {
		got[j.ID] = true
	}
	if !got[lagged] || !got[passedRecently] || !got[sameAfter] {
		t.Fatalf("first claim took %v; want %d (lagged), %d (passed recently), %d (next), in claim order",
			got, lagged, passedRecently, sameAfter)
	}
	params.Limit = 10
	rest, err := ensureAndClaim(ctx, db, params)
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range rest {
		got[j.ID] = true
	}
	if len(rest) != 2 || !got[later] || !got[lowerPrio] {
		t.Fatalf("second claim took %d jobs (%v); want %d and %d", len(rest), got, later, lowerPrio)
	}
	for _, id := range []int64{passedLongAgo, tooOld, higher} {
		if got[id] {
			t.Fatalf("a claim past the cursor took job %d, which is behind it", id)
		}
	}
	front, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"lag"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(front) != 3 {
		t.Fatalf("claim from the front: %d jobs, %v; want the 3 behind the cursor", len(front), err)
	}
}

// Jobs of a COPY that another transaction held locked while a claim passed them are found by
// the next claim past the cursor once the lock is gone, when they lie within the recheck.
func TestClaimAfterCursorFindsRowsItPassedLocked(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind) SELECT 'held', 'k' FROM generate_series(1, 100)`); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT id FROM leash.jobs WHERE queue = 'held' ORDER BY id LIMIT 20 OFFSET 5 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	p := store.ClaimParams{Queues: []string{"held"}, Limit: 30, WorkerID: "w", Lease: time.Minute}
	first, err := ensureAndClaim(ctx, db, p)
	if err != nil || len(first) != 30 {
		t.Fatalf("claim from the front: %d jobs, %v", len(first), err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	p.Limit, p.After, p.Lag, p.RecheckFromID = 100, store.LastClaimed(first), 100*time.Millisecond, 0
	rest, err := ensureAndClaim(ctx, db, p)
	if err != nil || len(rest) != 70 {
		t.Fatalf("claim past the cursor: %d jobs, %v; want the 70 left, the 20 once locked among them", len(rest), err)
	}
}

// After a COPY, every job has the same run_at: a claim past the cursor must start at the last
// job claimed, not walk the index entries of every job claimed before it, which stay in the
// index until vacuum (and for as long as an old snapshot holds it back).
func TestClaimAfterCursorSkipsClaimedEntries(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `
		ALTER TABLE leash.jobs SET (autovacuum_enabled = off);
		INSERT INTO leash.jobs (queue, kind) SELECT 'copy', 'k' FROM generate_series(1, 20000);
		ANALYZE leash.jobs`); err != nil {
		t.Fatal(err)
	}
	var last *store.ClaimCursor
	for range 100 {
		p := store.ClaimParams{Queues: []string{"copy"}, Limit: 100, WorkerID: "w", Lease: time.Minute, After: last, Lag: 100 * time.Millisecond}
		if last != nil {
			p.RecheckFromID = last.ID - 100
		}
		jobs, err := ensureAndClaim(ctx, db, p)
		if err != nil || len(jobs) != 100 {
			t.Fatalf("claim: %d jobs, %v", len(jobs), err)
		}
		last = store.LastClaimed(jobs)
	}
	indexBuffers := func(p store.ClaimParams) int {
		t.Helper()
		q, args := store.ClaimQuery(p)
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+q, args...)
		if err != nil {
			t.Fatal(err)
		}
		plans, err := pgx.CollectRows(rows, pgx.RowTo[[]map[string]any])
		if err != nil || len(plans) != 1 {
			t.Fatalf("explain: %v", err)
		}
		var sum func(n map[string]any) int
		sum = func(n map[string]any) int {
			total := 0
			if n["Index Name"] == "jobs_claimable_idx" {
				hit, _ := n["Shared Hit Blocks"].(float64)
				read, _ := n["Shared Read Blocks"].(float64)
				total += int(hit + read)
			}
			kids, _ := n["Plans"].([]any)
			for _, k := range kids {
				total += sum(k.(map[string]any))
			}
			return total
		}
		return sum(plans[0][0]["Plan"].(map[string]any))
	}
	p := store.ClaimParams{Queues: []string{"copy"}, Limit: 100, WorkerID: "w", Lease: time.Minute}
	fromFront := indexBuffers(p)
	// The claims of the last lag took 1000 of the 10000 claimed.
	p.After, p.Lag, p.RecheckFromID = last, 100*time.Millisecond, last.ID-1000
	pastCursor := indexBuffers(p)
	if fromFront < 20 || pastCursor > fromFront/4 {
		t.Fatalf("claim index pages read: %d from the front, %d past the cursor; want the cursor to skip the 10000 claimed entries", fromFront, pastCursor)
	}
	t.Logf("claim index pages read: %d from the front, %d past the cursor", fromFront, pastCursor)
}

// Rows with timestamps any SQL client may write (±infinity) are claimed like any other: a scan
// that failed after the claim committed would strand the whole batch until its leases expired.
func TestClaimReadsInfiniteTimestamps(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, run_at, created_at) VALUES
		('inf', 'k', '-infinity', 'infinity'), ('inf', 'k', now(), '-infinity'), ('inf', 'k', now(), now())`); err != nil {
		t.Fatal(err)
	}
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"inf"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("claim: %d jobs, %v; want all 3", len(jobs), err)
	}
	if c := store.LastClaimed(jobs); c == nil {
		t.Fatal("no cursor from claimed jobs")
	}
}

// A claim of several queues takes the heads of all of them in claim order (priority, run_at, id
// across the queues), and nothing of a paused queue.
func TestClaimManyQueuesInOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `
		INSERT INTO leash.jobs (queue, kind, priority) SELECT 'low', 'k', 5 FROM generate_series(1, 50);
		INSERT INTO leash.jobs (queue, kind, priority) SELECT 'high', 'k', 0 FROM generate_series(1, 3);
		INSERT INTO leash.jobs (queue, kind, priority) SELECT 'held', 'k', -9 FROM generate_series(1, 3);
		SELECT leash.pause_queue('held')`); err != nil {
		t.Fatal(err)
	}
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"low", "high", "held"}, Limit: 5, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 5 {
		t.Fatalf("claim: %d jobs, %v", len(jobs), err)
	}
	byQueue := map[string]int{}
	for _, j := range jobs {
		byQueue[j.Queue]++
	}
	if byQueue["high"] != 3 || byQueue["low"] != 2 || byQueue["held"] != 0 {
		t.Fatalf("claimed by queue %v; want the 3 of high (priority 0), then 2 of low, none of the paused queue", byQueue)
	}
	var available int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE queue = 'low' AND state = 'available'`).Scan(&available)
	if available != 48 {
		t.Fatalf("%d of low still available; want 48 (heads locked but not taken are released)", available)
	}
}

// genericPlanConn returns a connection of db that plans every prepared statement generically
// (as a connection does after five executions), on a leash.jobs autovacuum leaves alone, and a
// function that returns the plan of a statement on it.
func genericPlanConn(t *testing.T, db *pgxpool.Pool) (*pgxpool.Conn, func(stmt string) string) {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Exec(ctx, "RESET plan_cache_mode; DEALLOCATE ALL")
		conn.Release()
	})
	if _, err := conn.Exec(ctx, "ALTER TABLE leash.jobs SET (autovacuum_enabled = off); SET plan_cache_mode = force_generic_plan"); err != nil {
		t.Fatal(err)
	}
	return conn, func(stmt string) string {
		t.Helper()
		rows, err := conn.Query(ctx, "EXPLAIN (COSTS OFF) "+stmt)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}
}
