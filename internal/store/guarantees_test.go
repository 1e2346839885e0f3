package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// jp fills what pool.Insert fills before calling the store: the queue and max_attempts defaults.
func jp(p store.InsertParams) store.InsertParams {
	if p.Queue == "" {
		p.Queue = "default"
	}
	if p.MaxAttempts == 0 {
		p.MaxAttempts = 20
	}
	return p
}

func exec(t *testing.T, db store.DBTX, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// runningJob inserts a job and claims it for worker w.
func runningJob(t *testing.T, db store.DBTX, lease time.Duration) store.ClaimedJob {
	t.Helper()
	if _, err := store.Insert(context.Background(), db, jp(store.InsertParams{Kind: "k"})); err != nil {
		t.Fatal(err)
	}
	return claimOne(t, db, lease)
}

// claimOne claims a single job for worker w and returns it.
func claimOne(t *testing.T, db store.DBTX, lease time.Duration) store.ClaimedJob {
	t.Helper()
	jobs, err := ensureAndClaim(context.Background(), db, store.ClaimParams{Queues: []string{"default"}, Limit: 1, WorkerID: "w", Lease: lease})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim: %v, %d jobs", err, len(jobs))
	}
	return jobs[0]
}

func state(t *testing.T, db store.DBTX, id int64) (st string, attempt int, finished bool) {
	t.Helper()
	err := db.QueryRow(context.Background(), `SELECT state, attempt, finished_at IS NOT NULL FROM leash.jobs WHERE id = $1`, id).
		Scan(&st, &attempt, &finished)
	if err != nil {
		t.Fatal(err)
	}
	return
}

// A revoked job never becomes runnable again and an attempt of it that fails ends cancelled,
// whoever writes the outcome: this worker's Finish, a worker of an earlier release, a script.
func TestRevokedJobNeverRunnableAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for _, outcome := range []string{"retryable", "available", "failed"} {
		j := runningJob(t, db, time.Minute)
		id := j.ID
		if ok, err := store.Revoke(ctx, db, id, "stop"); err != nil || !ok {
			t.Fatalf("revoke: %v %v", ok, err)
		}
		ws, err := store.Finish(ctx, db, []store.Outcome{{ID: id, Token: j.Token, State: outcome,
			ReturnAttempt: outcome == "available", Error: &store.AttemptError{Attempt: 1, Error: "boom"}}})
		if err != nil || len(ws) != 1 || ws[0].State != "cancelled" {
			t.Fatalf("%s on a revoked job: wrote %+v, %v; want cancelled", outcome, ws, err)
		}
		if st, _, fin := state(t, db, id); st != "cancelled" || !fin {
			t.Fatalf("%s on a revoked job left it %s (finished %v)", outcome, st, fin)
		}
	}
	// A plain UPDATE by an older worker.
	j := runningJob(t, db, time.Minute)
	id := j.ID
	exec(t, db, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, id)
	exec(t, db, `UPDATE leash.jobs SET state = 'retryable', lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id = $1 AND lease_token = $2`, id, j.Token)
	if st, _, _ := state(t, db, id); st != "cancelled" {
		t.Fatalf("old-style retry of a revoked job left it %s", st)
	}
	// A completion still stands.
	j = runningJob(t, db, time.Minute)
	id = j.ID
	exec(t, db, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, id)
	ws, err := store.Finish(ctx, db, []store.Outcome{{ID: id, Token: j.Token, State: "completed"}})
	if err != nil || len(ws) != 1 || ws[0].State != "completed" {
		t.Fatalf("completion on a revoked job: %+v %v", ws, err)
	}
}

// Rows that an earlier release left revoked yet runnable are never claimed, and revoke_job
// cancels them.
func TestClaimSkipsRevokedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Triggers off: the row as a worker of the first release could leave it.
	exec(t, conn, `SET session_replication_role = replica`)
	var id int64
	if err := conn.QueryRow(ctx, `INSERT INTO leash.jobs (kind, state, revoked_at) VALUES ('k', 'retryable', now()) RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	exec(t, conn, `RESET session_replication_role`)
	conn.Release()
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 0 {
		t.Fatalf("claimed %+v (%v): a revoked row must never run", jobs, err)
	}
	if ok, err := store.Revoke(ctx, db, id, ""); err != nil || !ok {
		t.Fatalf("revoke: %v %v", ok, err)
	}
	if st, _, fin := state(t, db, id); st != "cancelled" || !fin {
		t.Fatalf("revoke_job left a revoked queued row %s", st)
	}
}

// Outcome text from outside the process (handler errors, panic values, reasons) may hold NUL
// bytes and invalid UTF-8, which PostgreSQL refuses; Finish stores the rest of it.
func TestFinishStoresHostileText(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, time.Minute)
	id := j.ID
	msg := "500: body \x00 with NUL, \xff\xfe bad bytes, and \\u0000 as text " + strings.Repeat("é", 20000)
	reason := "why\x00 \xc3"
	ws, err := store.Finish(ctx, db, []store.Outcome{{ID: id, Token: j.Token, State: "cancelled", Revoke: &reason,
		Error: &store.AttemptError{Attempt: 1, Error: msg, Stack: "\x00stack", Worker: "w\x00"}}})
	if err != nil || len(ws) != 1 {
		t.Fatalf("finish: %+v %v", ws, err)
	}
	var last, rr string
	db.QueryRow(ctx, `SELECT last_error, revoke_reason FROM leash.jobs WHERE id = $1`, id).Scan(&last, &rr)
	if !strings.HasPrefix(last, "500: body \uFFFD with NUL, \uFFFD bad bytes, and \\u0000 as text éé") ||
		!utf8.ValidString(last) || !strings.Contains(last, "more bytes cut]") || len(last) > store.MaxErrorBytes+100 {
		t.Fatalf("last_error %q...", last[:min(len(last), 120)])
	}
	if rr != "why\uFFFD \uFFFD" {
		t.Fatalf("revoke_reason %q", rr)
	}
	b, err := store.CleanJSON([]byte(`{"a\u0000":"x\u0000y","n":[1,"\u0000"]}`))
	if err != nil || string(b) != `{"a`+"\uFFFD"+`":"x`+"\uFFFD"+`y","n":[1,"`+"\uFFFD"+`"]}` {
		t.Fatalf("CleanJSON: %s %v", b, err)
	}
}

// Renewals never wait on a row lock: a long transaction writing one job's row (an operator's
// SELECT ... FOR UPDATE, a handler's own UPDATE of it) neither delays nor fails the renewal of the
// others.
func TestRenewSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	var held []store.ClaimedJob
	for range 3 {
		held = append(held, runningJob(t, db, time.Minute))
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM leash.jobs WHERE id = $1 FOR NO KEY UPDATE`, held[1].ID); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	ids, err := store.Renew(rctx, db, store.RenewParams{IDs: []int64{held[0].ID, held[1].ID, held[2].ID},
		Tokens: []int64{held[0].Token, held[1].Token, held[2].Token}, Lease: time.Minute})
	if err != nil {
		t.Fatalf("renewal waited on the locked row: %v", err)
	}
	if len(ids) != 2 || ids[0] == held[1].Token || ids[1] == held[1].Token {
		t.Fatalf("renewed %v; want the two unlocked leases", ids)
	}
	// SetProgress beside the open transaction fails instead of waiting forever; SetProgressTx
	// goes through it.
	err = store.SetProgress(ctx, db, held[1].ID, held[1].Token, []byte(`{"n":1}`))
	if err == nil || !strings.Contains(err.Error(), store.ErrRowBusy.Error()) {
		t.Fatalf("SetProgress beside a fenced transaction: %v", err)
	}
	if err := store.SetProgressTx(ctx, tx, held[1].ID, held[1].Token, []byte(`{"n":"\u0000"}`)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := store.SetProgress(ctx, db, held[1].ID, held[1].Token, []byte(`{"n":2}`)); err != nil {
		t.Fatal(err)
	}
	if err := store.SetProgress(ctx, db, held[1].ID, held[1].Token+1000, []byte(`{}`)); err != store.ErrFenced {
		t.Fatalf("stale SetProgress: %v", err)
	}
}

// A fenced write on a revoked job fails, so a revocation committed first wins over a handler's
// own transaction.
func TestFenceAndCompleteTxRefuseRevoked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, time.Minute)
	id := j.ID
	if ok, err := store.Revoke(ctx, db, id, ""); err != nil || !ok {
		t.Fatalf("revoke: %v %v", ok, err)
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return store.Fence(ctx, tx, id, j.Token) })
	if err != store.ErrRevokedRow {
		t.Fatalf("Fence on a revoked job: %v", err)
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return store.CompleteTx(ctx, tx, id, j.Token, nil) })
	if err != store.ErrRevokedRow {
		t.Fatalf("CompleteTx on a revoked job: %v", err)
	}
	if st, _, _ := state(t, db, id); st != "running" {
		t.Fatalf("state %s", st)
	}
}

// Every notification leash sends yields to a full notification queue: rescue, hand-back,
// revocation and retries write their rows and send nothing, rather than failing at commit.
func TestEveryNotifyGuarded(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	fullQueueShim(t, url)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "shim, pg_catalog, public"
	cfg.ConnConfig.RuntimeParams["shim.usage"] = "0.9"
	full, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer full.Close()

	listener, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	exec(t, listener, "LISTEN job_available; LISTEN job_revoked; LISTEN test_done")

	for range 4 {
		if _, err := store.Insert(ctx, full, jp(store.InsertParams{Kind: "k"})); err != nil {
			t.Fatal(err)
		}
	}
	var jobs []store.ClaimedJob
	for range 4 {
		jobs = append(jobs, claimOne(t, full, 10*time.Millisecond))
	}
	// Hand-back and a zero-delay retry notify job_available.
	if _, err := store.Finish(ctx, full, []store.Outcome{{ID: jobs[0].ID, Token: jobs[0].Token, State: "available", ReturnAttempt: true},
		{ID: jobs[1].ID, Token: jobs[1].Token, State: "retryable"}}); err != nil {
		t.Fatalf("finish with a full queue: %v", err)
	}
	// Revocation notifies job_revoked (revoke_job runs with a fixed search_path, so the trigger
	// path is taken through a plain UPDATE here; it is the same function).
	exec(t, full, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, jobs[2].ID)
	if _, err := store.MarkRevoked(ctx, full, []store.Revocation{{ID: jobs[3].ID, Token: jobs[3].Token, Attempt: 1, Reason: "r"}}); err != nil {
		t.Fatal(err)
	}
	// Rescue notifies job_revoked (takeover) and job_available.
	time.Sleep(20 * time.Millisecond) // the 10ms leases expire on the database clock
	exec(t, full, `UPDATE leash.jobs SET revoked_at = NULL WHERE id = $1`, jobs[3].ID)
	exec(t, full, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1s' WHERE state = 'running'`)
	if got, err := store.Rescue(ctx, full, 10); err != nil || len(got) == 0 {
		t.Fatalf("rescue with a full queue: %v %v", got, err)
	}
	exec(t, db, "NOTIFY test_done")
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(wctx)
		if err != nil {
			t.Fatal(err)
		}
		if n.Channel == "test_done" {
			break
		}
		t.Errorf("notification sent despite a full queue: %s %s", n.Channel, n.Payload)
	}
}

// Inserts notify only queues a live worker waits on: none when nobody waits, none for a
// registration that expired (a dead worker), one per waited-on queue per statement otherwise.
func TestInsertNotifiesOnlyWaitedQueues(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	listener, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	exec(t, listener, "LISTEN job_available; LISTEN test_done")
	insert := func(queue string) {
		if _, err := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k", Queue: queue})); err != nil {
			t.Fatal(err)
		}
	}
	insert("nobody") // no waiter at all
	if err := store.RegisterWaiter(ctx, db, "w1", []string{"busy", "idle"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := store.UnregisterWaiter(ctx, db, "w1"); err != nil {
		t.Fatal(err)
	}
	insert("busy") // its worker found work and unregistered
	exec(t, db, `INSERT INTO leash.waiters VALUES ('dead', 'gone', now() - interval '1 second')`)
	insert("dead") // registration expired
	if err := store.RegisterWaiter(ctx, db, "w2", []string{"idle"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	insert("idle")
	ps := make([]store.InsertParams, 1000)
	for i := range ps {
		ps[i] = jp(store.InsertParams{Kind: "k", Queue: []string{"idle", "nobody"}[i%2]})
	}
	if _, err := store.InsertMany(ctx, db, ps); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "NOTIFY test_done")
	var got []string
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(wctx)
		if err != nil {
			t.Fatal(err)
		}
		if n.Channel == "test_done" {
			break
		}
		got = append(got, n.Payload)
	}
	if strings.Join(got, ",") != "idle,idle" {
		t.Fatalf("notifications %v, want [idle idle] (one insert, one COPY)", got)
	}
}

// While no registration is live, an insert does not run the wake-up trigger's function at all
// (the trigger's WHEN reads leash.waiting_until); while one is, it does. Hand-made rows with
// infinite expiries are clamped, not errors.
func TestInsertSkipsTriggerFunctionWhileNobodyWaits(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	calls := func() int64 {
		t.Helper()
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		exec(t, tx, "SET LOCAL track_functions = 'pl'")
		// The view holds the backend's counts not yet reported, which can include earlier
		// transactions': count the difference.
		count := func() (n int64) {
			if err := tx.QueryRow(ctx, `
				SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions
				WHERE schemaname = 'leash' AND funcname = 'notify_job_available'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		before := count()
		if _, err := store.Insert(ctx, tx, jp(store.InsertParams{Kind: "k"})); err != nil {
			t.Fatal(err)
		}
		return count() - before
	}
	steps := []struct {
		name string
		sql  string
		want int64
	}{
		{"nobody registered", "SELECT", 0},
		{"a worker waits", "INSERT INTO leash.waiters VALUES ('default', 'w1', now() + interval '1 hour')", 1},
		{"it found work", "DELETE FROM leash.waiters WHERE waiter = 'w1'", 0},
		{"a dead worker's row", "INSERT INTO leash.waiters VALUES ('default', 'dead', now() - interval '1 second')", 0},
		{"a row that never expires", "INSERT INTO leash.waiters VALUES ('default', 'forever', 'infinity')", 1},
		{"and one long gone", "UPDATE leash.waiters SET expires_at = '-infinity' WHERE waiter = 'forever'", 0},
		{"registered again", "UPDATE leash.waiters SET expires_at = now() + interval '1 minute'", 1},
		{"emptied", "TRUNCATE leash.waiters", 0},
	}
	for _, s := range steps {
		exec(t, db, s.sql)
		if got := calls(); got != s.want {
			t.Fatalf("%s: the trigger's function ran %d times for one insert, want %d", s.name, got, s.want)
		}
	}
}

// Workers registering and unregistering at once leave the hint at the latest live expiry: an
// insert never skips a waiting worker's wake-up because two registrations raced.
func TestWaitingHintUnderConcurrentRegistrations(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	for round := range 5 {
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				name := fmt.Sprintf("w%d", w)
				for i := range 10 {
					if err := store.RegisterWaiter(ctx, db, name, []string{"a", "b"}, time.Duration(1+w+i)*time.Minute); err != nil {
						t.Error(err)
						return
					}
					if (w+i+round)%3 == 0 {
						if err := store.UnregisterWaiter(ctx, db, name); err != nil {
							t.Error(err)
							return
						}
					}
				}
			}()
		}
		wg.Wait()
		var hint, want int64
		if err := db.QueryRow(ctx, `
			SELECT pg_sequence_last_value('leash.waiting_until'),
			       coalesce(date_part('epoch', max(expires_at)) * 1000, 0)::bigint
			FROM leash.waiters`).Scan(&hint, &want); err != nil {
			t.Fatal(err)
		}
		if hint != want {
			t.Fatalf("round %d: hint %d, want the latest registration's expiry %d", round, hint, want)
		}
	}
}

// Outcomes and the next claim commit together or not at all: when the database refuses an
// outcome, the claim beside it does not happen either (no job left claimed by nobody).
func TestFinishAndClaimIsOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	for range 3 {
		if _, err := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k"})); err != nil {
			t.Fatal(err)
		}
	}
	j := claimOne(t, db, time.Minute)
	params := store.ClaimParams{Queues: []string{"default"}, Limit: 1, WorkerID: "w", Lease: time.Minute}
	_, _, err := ensureAndFinishAndClaim(ctx, db, []store.Outcome{{ID: j.ID, Token: j.Token, State: "exploded"}}, params)
	if err == nil {
		t.Fatal("a refused outcome did not fail the batch")
	}
	var running int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state = 'running'`).Scan(&running)
	if running != 1 {
		t.Fatalf("%d running after a failed finish-and-claim, want only the first claim", running)
	}
	ws, jobs, err := ensureAndFinishAndClaim(ctx, db, []store.Outcome{{ID: j.ID, Token: j.Token, State: "completed"}}, params)
	if err != nil || len(ws) != 1 || ws[0].State != "completed" || len(jobs) != 1 {
		t.Fatalf("finish and claim: %+v %+v %v", ws, jobs, err)
	}
}

// Progress values with escapes jsonb refuses (lone surrogates, NUL) are stored cleaned.
func TestProgressWithHostileEscapes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, time.Minute)
	for _, v := range []string{`{"a":"\ud800"}`, `{"\ud83d":1}`, `{"b":"x\u0000y"}`, `["\udfff\u0000"]`} {
		if err := store.SetProgress(ctx, db, j.ID, j.Token, []byte(v)); err != nil {
			t.Fatalf("SetProgress(%s): %v", v, err)
		}
	}
}

// A role that may only insert jobs inserts whether or not a worker waits (the trigger's WHEN
// reads leash.waiting_until, granted to PUBLIC), and cannot run the hint's owner-rights function
// from a trigger of its own, which could set the hint to "nobody waits".
func TestInserterRoleAndTheWaitingHint(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	conn := connAsRole(t, db, "leash_inserter",
		"GRANT USAGE ON SCHEMA leash TO %s",
		"GRANT INSERT ON leash.jobs TO %s",
		"GRANT USAGE ON ALL SEQUENCES IN SCHEMA leash TO %s",
		"REVOKE USAGE ON SEQUENCE leash.waiting_until FROM %s")
	insert := "INSERT INTO leash.jobs (kind) VALUES ('k')"
	if _, err := conn.Exec(ctx, insert); err != nil {
		t.Fatalf("insert while nobody waits: %v", err)
	}
	if err := store.RegisterWaiter(ctx, db, "w", []string{"default"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, insert); err != nil {
		t.Fatalf("insert while a worker waits: %v", err)
	}
	_, err := conn.Exec(ctx, `CREATE TEMP TABLE mine (x int);
		CREATE TRIGGER forged AFTER INSERT ON mine FOR EACH STATEMENT EXECUTE FUNCTION leash.set_waiting_until()`)
	if err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("a role of no rights attached the hint's function to its own table: %v", err)
	}
}

// connAsRole returns a connection of db acting as a new role (a unique name from prefix) that
// holds only what grants give it (each a statement with %s for the role's name). The role and
// what it owns are dropped when the test ends.
func connAsRole(t *testing.T, db *pgxpool.Pool, prefix string, grants ...string) *pgxpool.Conn {
	t.Helper()
	ctx := context.Background()
	role := fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1e9)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Exec(ctx, "RESET ROLE")
		conn.Release()
		db.Exec(ctx, "DROP OWNED BY "+role)
		db.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	stmts := []string{"CREATE ROLE " + role + " NOLOGIN"}
	for _, g := range grants {
		stmts = append(stmts, fmt.Sprintf(g, role))
	}
	for _, sql := range append(stmts, "SET ROLE "+role) {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	return conn
}
