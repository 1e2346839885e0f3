package pool_test

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// concurrency tracks how many handlers run at once and the most seen.
type concurrency struct {
	now, max atomic.Int64
}

func (c *concurrency) enter() {
	n := c.now.Add(1)
	for m := c.max.Load(); n > m && !c.max.CompareAndSwap(m, n); m = c.max.Load() {
	}
}

func (c *concurrency) leave() { c.now.Add(-1) }

// holding returns a handler that runs for d, counted by c.
func holding(c *concurrency, d time.Duration) pool.Handler {
	return pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		c.enter()
		defer c.leave()
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
		return nil
	})
}

func insertMany(t *testing.T, db *pgxpool.Pool, queue, kind string, n int) {
	t.Helper()
	if _, err := db.Exec(context.Background(),
		`INSERT INTO leash.jobs (queue, kind) SELECT $1, $2 FROM generate_series(1, $3)`, queue, kind, n); err != nil {
		t.Fatal(err)
	}
}

func count(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// Pausing a queue under a burn-down on two pools: no job starts once PauseQueue has returned
// (a claim whose transaction began before it may still start its jobs), running jobs finish,
// nothing more runs while it stays paused, and resuming drains the rest. With the listener
// down, the pause binds just the same (claims check the row) and the resume arrives by the poll.
func TestPauseStopsClaimsAtOnce(t *testing.T) {
	t.Parallel()
	for _, deaf := range []bool{false, true} {
		t.Run(fmt.Sprintf("listener_down=%v", deaf), func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			ctx := context.Background()
			const jobs = 3000
			insertMany(t, db, "q", "work", jobs)
			var c concurrency
			var pools []*pool.Pool
			for range 2 {
				cfg := fastConfig()
				cfg.Queues = []string{"q"}
				cfg.Concurrency = 4
				if deaf {
					deafListener(t, &cfg)
				}
				p, _ := setup(t, db, cfg, map[string]pool.Handler{"work": holding(&c, time.Millisecond)})
				start(t, p)
				pools = append(pools, p)
			}
			waitFor(t, 20*time.Second, func() bool {
				return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) >= 200
			})
			if ok, err := pool.PauseQueue(ctx, db, "q"); err != nil || !ok {
				t.Fatalf("PauseQueue = %v, %v; want true", ok, err)
			}
			var pausedBy time.Time
			if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&pausedBy); err != nil {
				t.Fatal(err)
			}
			if ok, err := pool.PauseQueue(ctx, db, "q"); err != nil || ok {
				t.Fatalf("PauseQueue again = %v, %v; want false (already paused)", ok, err)
			}
			waitFor(t, 10*time.Second, func() bool {
				return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'running'`) == 0
			})
			// Several polls pass: each pool re-reads the queues and claims again if it can.
			time.Sleep(5 * fastConfig().PollInterval)
			if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE attempted_at >= $1`, pausedBy); n != 0 {
				t.Fatalf("%d jobs were claimed after PauseQueue returned", n)
			}
			left := count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'available'`)
			if left == 0 {
				t.Fatal("the burn-down finished before the pause: nothing was tested")
			}
			for _, p := range pools {
				if !p.QueuesPaused()["q"] {
					t.Fatal("a pool does not report the queue paused")
				}
			}
			if ok, err := pool.ResumeQueue(ctx, db, "q"); err != nil || !ok {
				t.Fatalf("ResumeQueue = %v, %v; want true", ok, err)
			}
			waitFor(t, 30*time.Second, func() bool {
				return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == jobs
			})
			if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE attempt <> 1`); n != 0 {
				t.Fatalf("%d jobs ran more than once", n)
			}
		})
	}
}

// A paused queue stays paused through restarts of every worker, while the worker's other queues
// keep running; resuming drains it.
func TestPausedQueueSurvivesRestart(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := pool.PauseQueue(ctx, db, "held"); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "held", "noop", 20)
	insertMany(t, db, "other", "noop", 20)
	for round := range 2 {
		cfg := fastConfig()
		cfg.Queues = []string{"held", "other"}
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
		done := make(chan error, 1)
		go func() { done <- p.Run(context.Background()) }()
		if round == 0 {
			waitFor(t, 10*time.Second, func() bool {
				return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'other' AND state = 'completed'`) == 20
			})
		}
		time.Sleep(3 * cfg.PollInterval)
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		p.Shutdown(sctx)
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'held' AND attempt > 0`); n != 0 {
			t.Fatalf("round %d: %d jobs of the paused queue ran", round, n)
		}
	}
	cfg := fastConfig()
	cfg.Queues = []string{"held", "other"}
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	start(t, p)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	if _, err := pool.ResumeQueue(ctx, db, "held"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 40
	})
	qs, err := pool.ListQueues(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	// The pool created the row of the queue it serves that had none.
	if len(qs) != 2 || qs[0].Name != "held" || qs[0].PausedAt != nil || qs[0].Available != 0 ||
		qs[1].Name != "other" || qs[1].PausedAt != nil || qs[1].MaxRunning != nil {
		t.Fatalf("ListQueues = %+v; want held and other, active and empty", qs)
	}
}

// sampleRunning records the most jobs of queue seen running at once in the database until stop.
func sampleRunning(t *testing.T, db *pgxpool.Pool, queue string, stop <-chan struct{}) *atomic.Int64 {
	t.Helper()
	var most atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			var n int64
			if err := db.QueryRow(context.Background(),
				`SELECT count(*) FROM leash.jobs WHERE queue = $1 AND state = 'running'`, queue).Scan(&n); err != nil {
				return
			}
			if n > most.Load() {
				most.Store(n)
			}
		}
	}()
	t.Cleanup(wg.Wait)
	return &most
}

// A cap holds across four pools that together have far more free slots than the cap: neither
// the handlers running at once nor the rows running ever exceed it, and the queue drains.
func TestQueueCapHeldAcrossPools(t *testing.T) {
	t.Parallel()
	// Also with the isolation level a DBA may set for the database: the capped claim's count is
	// exact only under READ COMMITTED, which it sets for itself.
	for _, iso := range []string{"", "repeatable read", "serializable"} {
		t.Run(strings.ReplaceAll(cmp.Or(iso, "default"), " ", "_"), func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			if iso != "" {
				db = withDatabaseSetting(t, db, "default_transaction_isolation", iso)
			}
			queueCapHeldAcrossPools(t, db)
		})
	}
}

// withDatabaseSetting sets name for db's database, as a DBA does with ALTER DATABASE ... SET, and
// returns a new pool whose connections start with it.
func withDatabaseSetting(t *testing.T, db *pgxpool.Pool, name, value string) *pgxpool.Pool {
	t.Helper()
	url := db.Config().ConnString()
	pgtest.Exec(t, url, fmt.Sprintf(`ALTER DATABASE %s SET %s = '%s'`, dbIdent(t, url), pgx.Identifier{name}.Sanitize(), value))
	np := pgtest.PoolFor(t, url)
	var got string
	if err := np.QueryRow(context.Background(), `SELECT current_setting($1)`, name).Scan(&got); err != nil || got != value {
		t.Fatalf("%s on a new connection = %q, %v; want %q", name, got, err, value)
	}
	return np
}

func queueCapHeldAcrossPools(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	const capN, jobs = 3, 400
	if err := pool.SetQueueMaxRunning(ctx, db, "capped", capN); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "capped", "work", jobs)
	var c concurrency
	stop := make(chan struct{})
	most := sampleRunning(t, db, "capped", stop)
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"capped"}
		cfg.Concurrency = 5
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"work": holding(&c, 2*time.Millisecond)})
		start(t, p)
	}
	waitFor(t, 60*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == jobs
	})
	close(stop)
	if m := c.max.Load(); m > capN {
		t.Fatalf("%d handlers ran at once; the cap is %d", m, capN)
	}
	if m := most.Load(); m > capN {
		t.Fatalf("%d jobs were running at once in the database; the cap is %d", m, capN)
	}
	if c.max.Load() < 2 {
		t.Fatalf("at most %d handler ran at once: the pools never worked the queue concurrently", c.max.Load())
	}
}

// A change to a queue's row binds from its commit, with no settling time: four pools claim a
// capped queue while its cap is raised, lowered, removed and the queue paused, each change by
// plain SQL in a transaction that also reads which jobs are running and the last lease token
// drawn. Every claim that read the old row committed before the change did (so its jobs are
// among those read, or finished before the read); every job claimed after it started only while
// fewer than the new cap ran, counting the jobs still running from before; none started while
// the queue was paused.
func TestQueueCapChangedUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "q", 2); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "q", "work", 100000)
	var (
		mu   sync.Mutex
		runs = map[int64]*capRun{} // by lease token
	)
	handler := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		r := &capRun{start: time.Now()}
		mu.Lock()
		runs[j.Token] = r
		mu.Unlock()
		select {
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
		}
		mu.Lock()
		r.end = time.Now()
		mu.Unlock()
		return nil
	})
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"q"}
		cfg.Concurrency = 4
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"work": handler})
		start(t, p)
	}
	// change runs sql on the queue's row and returns what was running at its commit.
	change := func(sql string) capChange {
		t.Helper()
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		c := capChange{running: map[int64]bool{}}
		rows, err := tx.Query(ctx, `SELECT lease_token FROM leash.jobs WHERE queue = 'q' AND state = 'running'`)
		if err != nil {
			t.Fatal(err)
		}
		tokens, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		for _, tok := range tokens {
			c.running[tok] = true
		}
		if err := tx.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM leash.lease_tokens`).Scan(&c.lastToken); err != nil {
			t.Fatal(err)
		}
		c.read = time.Now()
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return c
	}
	// check verifies the claims around change c under capN (0: paused), once after jobs claimed
	// after it have run (want of them).
	check := func(name string, c capChange, capN int, want int) {
		t.Helper()
		after := func() (n int) {
			mu.Lock()
			defer mu.Unlock()
			for tok, r := range runs {
				if tok > c.lastToken && !r.end.IsZero() {
					n++
				}
			}
			return n
		}
		if want > 0 {
			waitFor(t, 20*time.Second, func() bool { return after() >= want })
		}
		mu.Lock()
		defer mu.Unlock()
		for tok, r := range runs {
			if tok <= c.lastToken && !c.running[tok] && (r.end.IsZero() || r.end.After(c.read)) {
				t.Fatalf("%s: a job claimed before the change (token %d) was not running at its commit and ran on after it", name, tok)
			}
			if tok <= c.lastToken {
				continue
			}
			if capN == 0 {
				t.Fatalf("%s: a job (token %d) started after the queue was paused", name, tok)
			}
			// At this job's start, how many ran: none claimed after the change starts unless
			// fewer than the cap run, whenever the others were claimed.
			at := 0
			for _, o := range runs {
				if !o.start.After(r.start) && (o.end.IsZero() || o.end.After(r.start)) {
					at++
				}
			}
			if at > capN {
				t.Fatalf("%s: %d jobs ran when a job claimed after the change (token %d) started; the cap is %d", name, at, tok, capN)
			}
		}
	}
	check("cap 2", change(`UPDATE leash.queues SET max_running = 2 WHERE name = 'q'`), 2, 100)
	check("raised to 6", change(`UPDATE leash.queues SET max_running = 6 WHERE name = 'q'`), 6, 100)
	check("lowered to 1", change(`UPDATE leash.queues SET max_running = 1 WHERE name = 'q'`), 1, 50)
	paused := change(`UPDATE leash.queues SET paused_at = now() WHERE name = 'q'`)
	time.Sleep(3 * fastConfig().PollInterval) // a window in which nothing may start
	check("raised to 6 while paused", change(`UPDATE leash.queues SET max_running = 6 WHERE name = 'q'`), 0, 0)
	check("paused", paused, 0, 0)
	check("resumed under 3", change(`UPDATE leash.queues SET paused_at = NULL, max_running = 3 WHERE name = 'q'`), 3, 50)
	// Without a cap all 16 slots fill; capped again by the Go API, at once.
	uncapped := change(`UPDATE leash.queues SET max_running = NULL WHERE name = 'q'`)
	waitFor(t, 20*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		now := time.Now()
		n := 0
		for tok, r := range runs {
			if tok > uncapped.lastToken && r.end.IsZero() && r.start.Before(now) {
				n++
			}
		}
		return n > 6
	})
	check("capped again at 2", change(`UPDATE leash.queues SET max_running = 2 WHERE name = 'q'`), 2, 50)
}

// capRun is one job's run in TestQueueCapChangedUnderLoad.
type capRun struct{ start, end time.Time }

// capChange is what a change to a queue's row saw at its commit: the lease tokens of the jobs
// running, the last token drawn (every job claimed after the commit has a larger one), and the
// time just before the commit.
type capChange struct {
	running   map[int64]bool
	lastToken int64
	read      time.Time
}

// Queue names from outside are checked before they reach SQL.
func TestQueueNamesChecked(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, name := range []string{"", "a\x00b", "\xff\xfe", string(make([]byte, 200))} {
		if _, err := pool.PauseQueue(ctx, db, name); err == nil {
			t.Errorf("PauseQueue(%q) succeeded", name)
		}
		if err := pool.SetQueueMaxRunning(ctx, db, name, 1); err == nil {
			t.Errorf("SetQueueMaxRunning(%q) succeeded", name)
		}
	}
	if ok, err := pool.ResumeQueue(ctx, db, "never-paused"); err != nil || ok {
		t.Fatalf("ResumeQueue of an unknown queue = %v, %v; want false, nil", ok, err)
	}
}

// A worker claims past the last job it claimed, but a job that becomes runnable ahead of that
// (here a higher priority inserted into a backlog) is still found by a claim from the front,
// long before the backlog is through.
func TestHigherPriorityFoundAheadOfTheCursor(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 2
	order := make(chan int64, 1000)
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"w": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		order <- j.ID
		return pool.Sleep(ctx, 5*time.Millisecond)
	})})
	insertMany(t, db, "default", "w", 400)
	start(t, p)
	for range 20 {
		<-order
	}
	urgent := insert(t, db, "w", nil, &pool.InsertOpts{Priority: -1})
	for n := 0; ; n++ {
		if id := <-order; id == urgent {
			if n > 100 {
				t.Fatalf("the urgent job started after %d others", n)
			}
			return
		}
	}
}

// A worker of several queues gives its capped queue its room under the cap, however much the
// uncapped ones have queued.
func TestCappedQueueAmongOthers(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "reports", 2); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "bulk", "bulk", 3000)
	insertMany(t, db, "reports", "report", 10)
	cfg := fastConfig()
	cfg.Queues = []string{"bulk", "reports"}
	cfg.Concurrency = 4
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"bulk": holding(&c, time.Millisecond), "report": holding(&c, time.Millisecond)})
	start(t, p)
	waitFor(t, 20*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'reports' AND state = 'completed'`) == 10
	})
	if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'bulk' AND state = 'completed'`); n == 3000 {
		t.Fatal("the reports waited for the whole bulk backlog")
	}
}

// A capped queue whose row a transaction holds (a change not yet committed, or a forgotten
// SELECT ... FOR UPDATE of a role allowed to update leash.queues) waits for that transaction, and
// the worker's other queues do not wait with it: the bulk queue drains at full speed (a claim
// that waited even a tenth of a second per round could not drain it in time). Once the
// transaction ends, the capped queue runs.
func TestHeldCappedQueueDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "reports", 2); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT * FROM leash.queues WHERE name = 'reports' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "reports", "report", 10)
	cfg := fastConfig()
	cfg.Queues = []string{"bulk", "reports"}
	cfg.Concurrency = 1
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"bulk": holding(&c, 0), "report": holding(&c, 0)})
	start(t, p)
	// One job per claim round: 200 rounds. Waiting 100ms per round for the held row would take
	// 20s.
	insertMany(t, db, "bulk", "bulk", 200)
	waitFor(t, 15*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'bulk' AND state = 'completed'`) == 200
	})
	if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'reports' AND attempt > 0`); n != 0 {
		t.Fatalf("%d jobs of the capped queue started while its row was held", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'reports' AND state = 'completed'`) == 10
	})
}

// A role without grants on schema leash cannot stop or slow claiming: it may not lock a queue's
// row (nor read leash.queues' rows to find one), and the advisory locks it may take are none
// that claims or registrations wait for. Here it holds the keys the previous release used for a
// capped queue's claims and for the waiting hint, while a worker of a capped and an uncapped queue
// drains both and registers as waiting.
func TestRoleWithoutGrantsCannotStallClaims(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "capq", 2); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("stranger_%d", time.Now().UnixNano()%1e9)
	t.Cleanup(func() {
		conn.Exec(ctx, "RESET ROLE")
		conn.Release()
		db.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	for _, sql := range []string{"CREATE ROLE " + role + " NOLOGIN", "GRANT USAGE ON SCHEMA leash TO " + role, "SET ROLE " + role} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	for _, sql := range []string{
		`SELECT FROM leash.queues WHERE name = 'capq' FOR UPDATE`,
		`SELECT FROM leash.queues WHERE name = 'capq' FOR KEY SHARE`,
		`SELECT FROM leash.waiting_hint_lock FOR UPDATE`,
	} {
		if _, err := conn.Exec(ctx, sql); err == nil {
			t.Fatalf("a role without grants ran %s", sql)
		}
	}
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(1818583411, hashtext('capq')), pg_advisory_lock(30510766707210100)`); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.Queues = []string{"capq", "other"}
	cfg.Concurrency = 2
	cfg.Engine.WaitAfter = time.Millisecond
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"w": holding(&c, 0)})
	start(t, p)
	insertMany(t, db, "capq", "w", 100)
	insertMany(t, db, "other", "w", 100)
	// Claims that waited a second per round for the capped queue's old key would run one round
	// a second: 100 s.
	waitFor(t, 30*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 200
	})
	// Idle now: the worker registers as waiting (so that inserts notify it) although the hint's
	// old key is held.
	waitFor(t, 10*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.waiters`) > 0
	})
}
