package store_test

// The queue row gate under attack: claims take their queue's row in leash.queues, and these are
// the ways a session setting, an operator's open transaction, a busy queue or an odd name could
// defeat it or stall other queues.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func mustExec(t *testing.T, db interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		if _, err := db.Exec(context.Background(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}

func runningOf(t *testing.T, db *pgxpool.Pool, queue string) int64 {
	t.Helper()
	var n int64
	if err := db.QueryRow(context.Background(),
		`SELECT count(*) FROM leash.jobs WHERE queue = $1 AND state = 'running'`, queue).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// The capped claim takes nothing unless it took the queue's row, whatever a session starts with:
// its mark is a value drawn for each claim, so ALTER ROLE ... IN DATABASE ... SET
// leash.capped_claim = 'locked' cannot pass for it. (With a fixed mark, a claim that did not get
// the row claimed and committed over the cap, and reported ErrQueueBusy with the jobs it leased
// never started.)
func TestCappedClaimMarkNotForgeableBySessionDefault(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	var dbname, user string
	if err := db.QueryRow(ctx, `SELECT current_database(), current_user`).Scan(&dbname, &user); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db,
		`INSERT INTO leash.queues (name, max_running) VALUES ('capq', 1)`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'capq', 'w' FROM generate_series(1, 5)`,
		fmt.Sprintf(`ALTER ROLE %s IN DATABASE %s SET leash.capped_claim = 'locked'`,
			pgx.Identifier{user}.Sanitize(), pgx.Identifier{dbname}.Sanitize()))
	worker, err := pgxpool.New(ctx, db.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer worker.Close()

	// Another worker's capped claim in flight: it holds the row and has claimed the one job the
	// cap allows, not yet committed.
	other, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	mustExec(t, other,
		`SELECT FROM leash.queues WHERE name = 'capq' FOR UPDATE`,
		`UPDATE leash.jobs SET state = 'running', lease_token = nextval('leash.lease_tokens'), leased_by = 'other',
		        lease_expires_at = now() + interval '1 minute', attempt = attempt + 1
		 WHERE id = (SELECT min(id) FROM leash.jobs WHERE queue = 'capq')`)

	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	jobs, err := store.ClaimCapped(sctx, worker, store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "me", Lease: time.Minute})
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var mine int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE leased_by = 'me' AND state = 'running'`).Scan(&mine); err != nil {
		t.Fatal(err)
	}
	t.Logf("ClaimCapped with the row held = %d jobs, %v; jobs leased to it in the database: %d", len(jobs), err, mine)
	if int64(len(jobs)) != mine {
		t.Errorf("ClaimCapped returned %d jobs (%v) but committed %d leases: they are stranded", len(jobs), err, mine)
	}
	if n := runningOf(t, db, "capq"); n > 1 {
		t.Errorf("%d jobs of capq running with max_running = 1", n)
	}
}

// The same through the connection string alone: options=-c leash.capped_claim=locked.
func TestCappedClaimMarkNotForgeableByConnOption(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	mustExec(t, db,
		`INSERT INTO leash.queues (name, max_running) VALUES ('capq', 1)`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'capq', 'w' FROM generate_series(1, 5)`)
	// As DATABASE_URL=...?options=-c%20leash.capped_claim%3Dlocked would.
	wcfg := db.Config().Copy()
	wcfg.ConnConfig.RuntimeParams["options"] = "-c leash.capped_claim=locked"
	worker, err := pgxpool.NewWithConfig(ctx, wcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer worker.Close()
	var setting string
	if err := worker.QueryRow(ctx, `SELECT coalesce(current_setting('leash.capped_claim', true), '<null>')`).Scan(&setting); err != nil || setting != "locked" {
		t.Fatalf("leash.capped_claim on the worker's connections = %q, %v", setting, err)
	}
	hold, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(ctx)
	// A change to the row in flight (a cap being lowered to 0): the claim must take nothing.
	mustExec(t, hold, `UPDATE leash.queues SET max_running = 0 WHERE name = 'capq'`)
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	jobs, err := store.ClaimCapped(sctx, worker, store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "me", Lease: time.Minute})
	if err := hold.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := runningOf(t, db, "capq"); n != 0 {
		t.Fatalf("%d jobs of capq started while its row was held by a change to max_running = 0 that then committed (ClaimCapped said %d jobs, %v)", n, len(jobs), err)
	}
}

// A pool creates its queues' rows; an operator's plain INSERT of such a queue's row still takes
// effect at once (the worker's row, holding nothing else, gives way to it).
func TestOperatorInsertAfterEnsure(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := store.EnsureQueues(ctx, db, []string{"mail"}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.queues (name, max_running) VALUES ('mail', 2)`); err != nil {
		t.Fatalf("an operator's INSERT of a queue's row after a worker created it: %v", err)
	}
	var capN int
	var implicit bool
	if err := db.QueryRow(ctx, `SELECT max_running, implicit FROM leash.queues WHERE name = 'mail'`).Scan(&capN, &implicit); err != nil || capN != 2 || implicit {
		t.Fatalf("mail's row: max_running %d, implicit %v, %v; want the operator's row", capN, implicit, err)
	}
	// A row an operator changed is the operator's: a second INSERT is refused, as on any table.
	if _, err := db.Exec(ctx, `INSERT INTO leash.queues (name, paused_at) VALUES ('mail', now())`); err == nil {
		t.Fatal("a second INSERT of mail's row succeeded")
	}
	// The worker's row of a queue an operator capped is never replaced.
	mustExec(t, db, `INSERT INTO leash.queues (name, implicit) VALUES ('other', true)`, `UPDATE leash.queues SET max_running = 3 WHERE name = 'other'`)
	if _, err := db.Exec(ctx, `INSERT INTO leash.queues (name) VALUES ('other')`); err == nil {
		t.Fatal("an INSERT replaced a worker's row that holds a cap")
	}
}

// A transaction that inserted a queue's row and has not ended (BEGIN; SELECT
// leash.pause_queue('new') forgotten in psql) holds back the creation of that row only, for a
// tenth of a second: the other rows are created. (One statement for every row waited up to 10 s
// and then created none.)
func TestEnsureQueuesAroundAnOpenInsert(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	op, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer op.Rollback(ctx)
	mustExec(t, op, `SELECT leash.pause_queue('newq')`)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	began := time.Now()
	err = store.EnsureQueues(sctx, db, []string{"newq", "busy"})
	if took := time.Since(began); err == nil || took > 1500*time.Millisecond { // not sctx's 2 s
		t.Fatalf("EnsureQueues with another transaction's insert of one row open: %v after %s; want newq's lock timeout (100ms) well before sctx's 2s", err, took.Round(time.Millisecond))
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.queues WHERE name = 'busy' AND implicit`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("busy's row: %d, %v; want it created", n, err)
	}
}

// A busy queue can be paused: FOR SHARE requests do not queue behind a waiting writer (a share
// request on a row only share-locked never sleeps), so claims overlapping without a gap would
// hold pause_queue off for ever; the change hint makes new claims stand back while it waits. Here
// a 20 ms trigger on the claim's UPDATE stands for what a loaded server or a commit waiting for a
// synchronous replica costs every claim, and six claimers loop on the queue. Without the hint the
// pause timed out after 10 s in every run. Also reports the multixacts consumed per claim.
func TestPauseNotStarvedByClaims(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	mustExec(t, db, `INSERT INTO leash.queues (name) VALUES ('hot')`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'hot', 'w' FROM generate_series(1, 200000)`, `ANALYZE leash.jobs`,
		`CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.02); RETURN NULL; END $$`,
		`CREATE TRIGGER slow_commit AFTER UPDATE ON leash.jobs FOR EACH STATEMENT EXECUTE FUNCTION slow_commit()`)
	cfg := db.Config().Copy()
	const claimers = 6
	cfg.MaxConns = claimers + 2
	wp, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer wp.Close()
	var mx0 int64
	if err := db.QueryRow(ctx, `SELECT mxid_age(datminmxid) FROM pg_database WHERE datname = current_database()`).Scan(&mx0); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var claims atomic.Int64
	for i := range claimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// One claim statement, autocommit, as a pool's claim of an uncapped queue.
				if _, err := store.Claim(ctx, wp, store.ClaimParams{Queues: []string{"hot"}, Limit: 20, WorkerID: fmt.Sprint("w", i), Lease: time.Minute}); err != nil {
					return
				}
				claims.Add(1)
			}
		}()
	}
	// Pause only once every claimer is claiming in a loop.
	for warm := time.Now().Add(20 * time.Second); claims.Load() < 5*claimers && time.Now().Before(warm); {
		time.Sleep(time.Millisecond)
	}
	began := time.Now()
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, perr := db.Exec(pctx, `SELECT leash.pause_queue('hot')`)
	cancel()
	took := time.Since(began)
	close(stop)
	wg.Wait()
	var mx1 int64
	if err := db.QueryRow(ctx, `SELECT mxid_age(datminmxid) FROM pg_database WHERE datname = current_database()`).Scan(&mx1); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d claims, %d multixacts consumed (%.2f per claim); pause_queue took %s (%v)",
		claims.Load(), mx1-mx0, float64(mx1-mx0)/float64(max(claims.Load(), 1)), took.Round(time.Millisecond), perr)
	if perr != nil || took > 2*time.Second {
		t.Fatalf("pause_queue under %d claimers of the queue: %v after %s; want it to commit at once", claimers, perr, took.Round(time.Millisecond))
	}
}

// A capped claim whose claim statement fails inside the batch's explicit transaction leaves the
// connection in a failed transaction block; the pool does not hand that connection out again.
func TestFailedCappedClaimLeavesNoOpenTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	mustExec(t, db,
		`INSERT INTO leash.queues (name, max_running) VALUES ('capq', 5)`,
		`INSERT INTO leash.jobs (queue, kind) SELECT 'capq', 'w' FROM generate_series(1, 3)`,
		`CREATE FUNCTION fail_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no'; END $$`,
		`CREATE TRIGGER fail_claim BEFORE UPDATE ON leash.jobs FOR EACH ROW EXECUTE FUNCTION fail_claim()`)
	cfg := db.Config().Copy()
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	if _, err := store.ClaimCapped(ctx, one, store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "w", Lease: time.Minute}); err == nil {
		t.Fatal("the claim succeeded through a failing trigger")
	}
	var status string
	if err := one.QueryRow(ctx, `SELECT CASE WHEN txid_current_if_assigned() IS NULL THEN 'clean' ELSE 'in a transaction' END`).Scan(&status); err != nil || status != "clean" {
		t.Fatalf("the next statement on the pool: %q, %v", status, err)
	}
	mustExec(t, db, `DROP TRIGGER fail_claim ON leash.jobs`)
	if jobs, err := store.ClaimCapped(ctx, one, store.ClaimParams{Queues: []string{"capq"}, Limit: 10, WorkerID: "w", Lease: time.Minute}); err != nil || len(jobs) != 3 {
		t.Fatalf("the next capped claim = %d jobs, %v", len(jobs), err)
	}
}

// A name the table refuses (here, in a LATIN1 database, a name of 100 two-byte runes the pool's
// config accepted, over the CHECK's 128 bytes) fails the creation of its own row only: the other
// queues get theirs and run.
func TestOneBadQueueNameStopsOnlyItself(t *testing.T) {
	t.Parallel()
	base := pgtest.Pool(t)
	ctx := context.Background()
	name := fmt.Sprintf("latin1_%d", time.Now().UnixNano()%1e9)
	mustExec(t, base, fmt.Sprintf(`CREATE DATABASE %s ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`, name))
	cfg := base.Config().Copy()
	cfg.ConnConfig.Database = name
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(ctx, conn.Conn()); err != nil {
		t.Fatal(err)
	}
	conn.Release()
	mustExec(t, db, `INSERT INTO leash.jobs (queue, kind) SELECT 'mail', 'w' FROM generate_series(1, 3)`)
	// 100 runes (200 bytes of UTF-8, which pgx sends as is: client_encoding is the database's),
	// accepted by pool.Config.Validate; length() in a LATIN1 database counts 200.
	queues := []string{"mail", strings.Repeat("é", 100)}
	ensureErr := store.EnsureQueues(ctx, db, queues)
	var enc string
	db.QueryRow(ctx, `SELECT current_setting('server_encoding') || '/' || current_setting('client_encoding') || '/' || (SELECT encoding::text FROM pg_database WHERE datname = current_database()) || '/' || string_agg(name, ',') FROM leash.queues`).Scan(&enc)
	t.Logf("EnsureQueues = %v; rows: %s", ensureErr, enc)
	jobs, err := store.Claim(ctx, db, store.ClaimParams{Queues: queues, Limit: 10, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("queue mail claimed %d jobs (%v) after EnsureQueues(%q) = %v; want 3", len(jobs), err, queues, ensureErr)
	}
}

// set_config runs only for the row the subquery locked: the subquery keeps its LockRows node
// under the projection (a subquery with FOR UPDATE is never pulled up), for custom and generic
// plans. And a row whose queue was renamed by a committed UPDATE after the statement's snapshot
// is rechecked and not returned.
func TestCappedLockStatementPlan(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	mustExec(t, db, `INSERT INTO leash.queues (name, max_running) VALUES ('capq', 1)`)
	const lock = `SELECT pg_catalog.set_config('leash.capped_claim', 'locked', true)
	FROM (SELECT FROM leash.queues q WHERE q.name = $1 FOR UPDATE SKIP LOCKED) AS locked`
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		conn, err := db.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mustExec(t, conn, "SET plan_cache_mode = "+mode, "PREPARE l(text) AS "+lock)
		rows, err := conn.Query(ctx, `EXPLAIN (VERBOSE, COSTS OFF) EXECUTE l('capq')`)
		if err != nil {
			t.Fatal(err)
		}
		plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		mustExec(t, conn, "DEALLOCATE l")
		conn.Release()
		text := strings.Join(plan, "\n")
		t.Logf("%s:\n%s", mode, text)
		// The projection with set_config must be above the LockRows node.
		si, li := strings.Index(text, "set_config"), strings.Index(text, "LockRows")
		if si < 0 || li < 0 || si > li {
			t.Fatalf("%s: set_config is not evaluated above the row lock:\n%s", mode, text)
		}
	}
}
