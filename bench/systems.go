package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/pool"
)

// River's side: a no-op worker and a sleeper that reports when its context is cancelled.

type noopArgs struct{}

func (noopArgs) Kind() string { return "noop" }

type noopWorker struct{ river.WorkerDefaults[noopArgs] }

func (*noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

type sleepArgs struct {
	MS int `json:"ms"`
}

func (sleepArgs) Kind() string { return "sleep" }

type sleepWorker struct {
	river.WorkerDefaults[sleepArgs]
	started   chan int64
	cancelled chan time.Time
}

func (w *sleepWorker) Timeout(*river.Job[sleepArgs]) time.Duration { return -1 }

func (w *sleepWorker) Work(ctx context.Context, j *river.Job[sleepArgs]) error {
	if w.started != nil {
		w.started <- j.ID
	}
	select {
	case <-time.After(time.Duration(j.Args.MS) * time.Millisecond):
		return nil
	case <-ctx.Done():
		if w.cancelled != nil {
			w.cancelled <- time.Now()
		}
		return ctx.Err()
	}
}

// riverTuning names River's settings in the table.
type riverTuning int

const (
	riverDefaults riverTuning = iota
	riverTuned                // its benchmark settings: 2ms fetch cooldown, 20ms poll
)

func (t riverTuning) String() string {
	if t == riverTuned {
		return "River tuned"
	}
	return "River defaults"
}

// newRiver returns a stopped River client on db with maxWorkers slots.
func newRiver(db *pgxpool.Pool, maxWorkers int, tuning riverTuning, sleeper *sleepWorker) *river.Client[pgx.Tx] {
	workers := river.NewWorkers()
	river.AddWorker(workers, &noopWorker{})
	if sleeper == nil {
		sleeper = &sleepWorker{}
	}
	river.AddWorker(workers, sleeper)
	cfg := &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}},
		Workers: workers,
		Logger:  slog.New(slog.DiscardHandler),
	}
	if tuning == riverTuned {
		cfg.FetchCooldown, cfg.FetchPollInterval = 2*time.Millisecond, 20*time.Millisecond
	}
	c, err := river.NewClient(riverpgxv5.New(db), cfg)
	if err != nil {
		fail(err)
	}
	return c
}

// riverInsertNoops inserts n no-op jobs with COPY.
func riverInsertNoops(ctx context.Context, c *river.Client[pgx.Tx], n int) {
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: noopArgs{}}
	}
	for i := 0; i < n; i += 10000 {
		if _, err := c.InsertManyFast(ctx, params[i:min(i+10000, n)]); err != nil {
			fail(err)
		}
	}
}

// riverDrain starts c and returns the time from start to the n-th completed job.
func riverDrain(ctx context.Context, c *river.Client[pgx.Tx], n int) time.Duration {
	events, cancel := c.SubscribeConfig(&river.SubscribeConfig{ChanSize: n + 1000, Kinds: []river.EventKind{river.EventKindJobCompleted}})
	defer cancel()
	began := time.Now()
	if err := c.Start(ctx); err != nil {
		fail(err)
	}
	for range n {
		<-events
	}
	d := time.Since(began)
	stopRiver(c)
	return d
}

func stopRiver(c *river.Client[pgx.Tx]) {
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Stop(sctx); err != nil {
		c.StopAndCancel(context.Background())
	}
}

// leash's side.

// counter is a pool.Observer that closes done after n finished jobs.
type counter struct {
	n, target int64
	done      chan struct{}
}

func newCounter(target int) *counter {
	return &counter{target: int64(target), done: make(chan struct{})}
}

func (c *counter) JobFinished(pool.JobEvent) {
	if atomic.AddInt64(&c.n, 1) == c.target {
		close(c.done)
	}
}

// newLeash returns a pool on db with its defaults but for concurrency, and the extra handlers.
// newLeashConfig is a leash pool with cfg and the noop handler.
func newLeashConfig(db *pgxpool.Pool, cfg pool.Config) *pool.Pool {
	p, err := pool.New(db, cfg)
	if err != nil {
		fail(err)
	}
	p.Register("noop", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }))
	return p
}

func newLeash(db *pgxpool.Pool, concurrency int, obs pool.Observer, handlers map[string]pool.Handler) *pool.Pool {
	p, err := pool.New(db, pool.Config{Concurrency: concurrency, Observer: obs})
	if err != nil {
		fail(err)
	}
	p.Register("noop", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }))
	for k, h := range handlers {
		p.Register(k, h)
	}
	return p
}

func leashInsertNoops(ctx context.Context, db *pgxpool.Pool, n int) {
	params := make([]pool.InsertManyParams, n)
	for i := range params {
		params[i].Kind = "noop"
	}
	if _, err := pool.InsertMany(ctx, db, params); err != nil {
		fail(err)
	}
}

// leashDrain runs p until c has seen every job finish and returns the time from start to the
// last committed completion.
func leashDrain(ctx context.Context, p *pool.Pool, c *counter) time.Duration {
	began := time.Now()
	go p.Run(ctx)
	<-c.done
	d := time.Since(began)
	p.Shutdown(context.Background())
	return d
}

// rawFloor is the cost any queue on leash's schema pays: one goroutine claiming 100 jobs and
// completing those 100 per round, with nothing else.
func rawFloor(ctx context.Context, db *pgxpool.Pool, n int) time.Duration {
	// Claims take a queue only through its row in leash.queues, which a pool creates.
	if err := store.EnsureQueues(ctx, db, []string{"default"}); err != nil {
		fail(err)
	}
	began := time.Now()
	done := 0
	for done < n {
		jobs, err := store.Claim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 100, WorkerID: "raw", Lease: time.Minute})
		if err != nil {
			fail(err)
		}
		if len(jobs) == 0 && time.Since(began) > time.Minute {
			fail(fmt.Errorf("leash statements, serial: nothing claimed after %s with %d of %d done", time.Since(began), done, n))
		}
		outs := make([]store.Outcome, len(jobs))
		for i, j := range jobs {
			outs[i] = store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted}
		}
		if _, err := store.Finish(ctx, db, outs); err != nil {
			fail(err)
		}
		done += len(jobs)
	}
	return time.Since(began)
}
