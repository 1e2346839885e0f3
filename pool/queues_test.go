package pool_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
	if len(qs) != 1 || qs[0].Name != "held" || qs[0].PausedAt != nil || qs[0].Available != 0 {
		t.Fatalf("ListQueues = %+v; want only held, active and empty", qs)
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
	db := pgtest.Pool(t)
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

// A cap raised under load lets more run at once from the next claim; lowered, no new job starts
// until the queue is under the new cap, and from then on it holds.
func TestQueueCapChangedUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "q", 2); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "q", "work", 100000)
	var c concurrency
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"q"}
		cfg.Concurrency = 4
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"work": holding(&c, 5*time.Millisecond)})
		start(t, p)
	}
	phase := func(name string, capN int64, until func() bool) {
		t.Helper()
		// Whatever ran before the change finishes; then the new cap alone decides.
		waitFor(t, 10*time.Second, func() bool {
			return c.now.Load() <= capN &&
				count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'q' AND state = 'running'`) <= capN
		})
		c.max.Store(c.now.Load())
		stop := make(chan struct{})
		most := sampleRunning(t, db, "q", stop)
		waitFor(t, 20*time.Second, until)
		close(stop)
		if m := c.max.Load(); m > capN {
			t.Fatalf("%s: %d handlers ran at once; the cap is %d", name, m, capN)
		}
		if m := most.Load(); m > capN {
			t.Fatalf("%s: %d jobs running at once in the database; the cap is %d", name, m, capN)
		}
	}
	completed := func() int64 { return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) }
	base := completed()
	phase("cap 2", 2, func() bool { return completed() >= base+100 })

	if err := pool.SetQueueMaxRunning(ctx, db, "q", 6); err != nil {
		t.Fatal(err)
	}
	phase("raised to 6", 6, func() bool { return c.max.Load() > 2 })

	if err := pool.SetQueueMaxRunning(ctx, db, "q", 1); err != nil {
		t.Fatal(err)
	}
	base = completed()
	phase("lowered to 1", 1, func() bool { return completed() >= base+50 })

	// Without a cap all 16 slots fill.
	if err := pool.SetQueueMaxRunning(ctx, db, "q", -1); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return c.now.Load() > 6 })
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
// uncapped ones have queued; and nobody holding a queue's row (a forgotten transaction in psql)
// can stall its claims.
func TestCappedQueueAmongOthers(t *testing.T) {
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
