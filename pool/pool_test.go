package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) {
	if runHelperWorker() {
		return
	}
	pgtest.Main(m)
}

// events is an Observer that turns finished jobs into a channel: tests wait on it instead of
// sleeping.
type events chan pool.JobEvent

func (e events) JobFinished(ev pool.JobEvent) { e <- ev }

// wait returns the next n events or fails the test after timeout.
func (e events) wait(t *testing.T, n int, timeout time.Duration) []pool.JobEvent {
	t.Helper()
	var got []pool.JobEvent
	deadline := time.After(timeout)
	for len(got) < n {
		select {
		case ev := <-e:
			got = append(got, ev)
		case <-deadline:
			t.Fatalf("waited %s for %d finished jobs, got %d: %+v", timeout, n, len(got), got)
		}
	}
	return got
}

type bundle struct {
	db     *pgxpool.Pool
	events events
}

// fastConfig is a configuration with short timings for tests.
func fastConfig() pool.Config {
	return pool.Config{
		Concurrency:       10,
		LeaseDuration:     2 * time.Second,
		HeartbeatInterval: 200 * time.Millisecond,
		PollInterval:      100 * time.Millisecond,
		ShutdownTimeout:   2 * time.Second,
		RetryBackoff:      func(int) time.Duration { return 0 },
	}
}

// setup returns a pool on a fresh database with the given handlers, not yet running.
func setup(t *testing.T, db *pgxpool.Pool, cfg pool.Config, handlers map[string]pool.Handler) (*pool.Pool, *bundle) {
	t.Helper()
	if db == nil {
		db = pgtest.Pool(t)
	}
	b := &bundle{db: db, events: make(events, 100000)}
	if cfg.Observer == nil {
		cfg.Observer = b.events
	}
	if os.Getenv("LEASH_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	p, err := pool.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for kind, h := range handlers {
		if err := p.Register(kind, h); err != nil {
			t.Fatal(err)
		}
	}
	return p, b
}

// start runs p until the test ends.
func start(t *testing.T, p *pool.Pool) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p.Shutdown(ctx)
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

type row struct {
	State       string
	Attempt     int
	Token       *int64
	LeasedBy    *string
	Expires     *time.Time
	LastError   *string
	Errors      []map[string]any
	FinishedAt  *time.Time
	RunAt       time.Time
	AttemptedAt *time.Time
	Revoked     bool
	Progress    []byte
}

func getRow(t *testing.T, db *pgxpool.Pool, id int64) row {
	t.Helper()
	var r row
	err := db.QueryRow(context.Background(), `
		SELECT state, attempt, lease_token, leased_by, lease_expires_at, last_error, errors, finished_at, run_at,
		       attempted_at, revoked_at IS NOT NULL, progress
		FROM leash.jobs WHERE id = $1`, id).Scan(&r.State, &r.Attempt, &r.Token, &r.LeasedBy, &r.Expires,
		&r.LastError, &r.Errors, &r.FinishedAt, &r.RunAt, &r.AttemptedAt, &r.Revoked, &r.Progress)
	if err != nil {
		t.Fatalf("read job %d: %v", id, err)
	}
	return r
}

func insert(t *testing.T, db pool.DB, kind string, payload any, opts *pool.InsertOpts) int64 {
	t.Helper()
	id, err := pool.Insert(context.Background(), db, kind, payload, opts)
	if err != nil {
		t.Fatalf("insert %s: %v", kind, err)
	}
	return id
}

func noop() pool.Handler {
	return pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })
}

func TestCompleted(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"noop": noop()})
	id := insert(t, b.db, "noop", map[string]int{"n": 1}, nil)
	start(t, p)
	ev := b.events.wait(t, 1, 10*time.Second)[0]
	if ev.State != "completed" || ev.Kind != "noop" || ev.Queue != "default" || ev.Stale {
		t.Fatalf("event %+v", ev)
	}
	r := getRow(t, b.db, id)
	if r.State != "completed" || r.Attempt != 1 || r.Token != nil || r.LeasedBy != nil || r.Expires != nil || r.FinishedAt == nil {
		t.Fatalf("row %+v", r)
	}
}

func TestRetryThenFail(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"flaky": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		calls.Add(1)
		return fmt.Errorf("boom %d", j.Attempt)
	})})
	id := insert(t, b.db, "flaky", nil, &pool.InsertOpts{MaxAttempts: 2})
	start(t, p)
	evs := b.events.wait(t, 2, 10*time.Second)
	if evs[0].State != "retryable" || evs[1].State != "failed" {
		t.Fatalf("states %s, %s", evs[0].State, evs[1].State)
	}
	r := getRow(t, b.db, id)
	if r.State != "failed" || r.Attempt != 2 || *r.LastError != "boom 2" || len(r.Errors) != 2 {
		t.Fatalf("row %+v", r)
	}
	if r.Errors[0]["error"] != "boom 1" || r.Errors[0]["attempt"] != float64(1) || r.Errors[0]["at"] == nil {
		t.Fatalf("errors history %+v", r.Errors)
	}
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times", calls.Load())
	}
}

func TestPermanentFailsAtOnce(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"bad": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		return pool.Permanent(errors.New("never works"))
	})})
	id := insert(t, b.db, "bad", nil, nil)
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, b.db, id); r.State != "failed" || r.Attempt != 1 || *r.LastError != "never works" {
		t.Fatalf("row %+v", r)
	}
}

func TestPanicRecordedWithStack(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"panic": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		panic("kaboom")
	})})
	id := insert(t, b.db, "panic", nil, &pool.InsertOpts{MaxAttempts: 1})
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	r := getRow(t, b.db, id)
	if r.State != "failed" || !strings.Contains(*r.LastError, "kaboom") {
		t.Fatalf("row %+v", r)
	}
	if st, _ := r.Errors[0]["stack"].(string); !strings.Contains(st, "pool_test.go") {
		t.Fatalf("no stack in %+v", r.Errors[0])
	}
	if p.Stats().Panics != 1 {
		t.Fatal("panic not counted")
	}
}

// A job of a kind the worker has no handler for (a rolling deploy: a producer of the new version
// inserts it before this worker knows the kind) fails its attempt with ErrUnknownKind and is
// retried, so a worker that knows the kind runs it; only its last attempt fails it. The worker
// goes on working, and Register after Run is refused.
func TestUnknownKindRetriedUntilAWorkerKnowsIt(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.RetryBackoff = func(int) time.Duration { return time.Hour }
	old, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": noop()})
	later := insert(t, b.db, "report", nil, &pool.InsertOpts{MaxAttempts: 5})
	last := insert(t, b.db, "report", nil, &pool.InsertOpts{MaxAttempts: 1})
	start(t, old)
	b.events.wait(t, 2, 10*time.Second)
	if err := old.Register("report", noop()); !errors.Is(err, pool.ErrStarted) {
		t.Fatalf("Register after Run: %v, want ErrStarted", err)
	}
	r := getRow(t, b.db, last)
	if r.State != "failed" || r.Attempt != 1 || !strings.Contains(*r.LastError, `"report"`) {
		t.Fatalf("a job on its last attempt: %+v", r)
	}
	good := insert(t, b.db, "noop", nil, nil)
	if ev := b.events.wait(t, 1, 10*time.Second)[0]; ev.Kind != "noop" || getRow(t, b.db, good).State != "completed" {
		t.Fatalf("the worker stopped working: %+v", ev)
	}
	if r := getRow(t, b.db, later); r.State != "retryable" || r.Attempt != 1 || r.LastError == nil ||
		!strings.Contains(*r.LastError, "no handler registered") || !strings.Contains(*r.LastError, `"report"`) {
		t.Fatalf("a job with attempts left: %+v", r)
	}

	// The old worker goes, the backoff passes (an operator moves it), and a worker that knows
	// the kind runs it.
	if err := old.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	mustExec(t, b.db, `UPDATE leash.jobs SET run_at = now() WHERE id = $1`, later)
	cfg.ID = "new-version"
	upgraded, b2 := setup(t, b.db, cfg, map[string]pool.Handler{"report": noop()})
	start(t, upgraded)
	if ev := b2.events.wait(t, 1, 10*time.Second)[0]; ev.Kind != "report" || ev.State != "completed" {
		t.Fatalf("the upgraded worker: %+v", ev)
	}
	if r := getRow(t, b.db, later); r.State != "completed" || r.Attempt != 2 {
		t.Fatalf("the upgraded worker did not run it: %+v", r)
	}
}

func TestArgsDecodeFailureNamesKindAndField(t *testing.T) {
	t.Parallel()
	type args struct {
		Count int `json:"count"`
	}
	var mu sync.Mutex
	got := map[int64]int{}
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"typed": pool.Args(func(_ context.Context, j *pool.Job, a args) error {
		mu.Lock()
		defer mu.Unlock()
		got[j.ID] = a.Count
		return nil
	})})
	bad := insert(t, b.db, "typed", map[string]any{"count": "many"}, nil)
	unknown := insert(t, b.db, "typed", map[string]any{"cuont": 3}, nil)
	good := insert(t, b.db, "typed", map[string]any{"count": 7}, nil)
	start(t, p)
	b.events.wait(t, 3, 10*time.Second)
	if r := getRow(t, b.db, bad); r.State != "failed" || r.Attempt != 1 || !strings.Contains(*r.LastError, "typed") || !strings.Contains(*r.LastError, `"count"`) {
		t.Fatalf("bad payload row %+v", r)
	}
	// A field the handler's type does not have is ignored (a newer producer may add one).
	if r := getRow(t, b.db, unknown); r.State != "completed" {
		t.Fatalf("unknown field row %+v", r)
	}
	mu.Lock()
	defer mu.Unlock()
	if r := getRow(t, b.db, good); r.State != "completed" || got[good] != 7 || got[unknown] != 0 {
		t.Fatalf("good row %+v, decoded %v", r, got)
	}
}

func TestScheduledAndPriority(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var order []string
	cfg := fastConfig()
	cfg.Concurrency = 1
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"rec": pool.Args(func(_ context.Context, _ *pool.Job, a struct{ Name string }) error {
		mu.Lock()
		order = append(order, a.Name)
		mu.Unlock()
		return nil
	})})
	later := insert(t, b.db, "rec", map[string]string{"Name": "later"}, &pool.InsertOpts{Delay: time.Hour})
	insert(t, b.db, "rec", map[string]string{"Name": "low"}, &pool.InsertOpts{Priority: 5})
	insert(t, b.db, "rec", map[string]string{"Name": "high"}, &pool.InsertOpts{Priority: -1})
	start(t, p)
	b.events.wait(t, 2, 10*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(order, ",") != "high,low" {
		t.Fatalf("order %v", order)
	}
	if r := getRow(t, b.db, later); r.State != "available" || r.Attempt != 0 {
		t.Fatalf("scheduled job ran: %+v", r)
	}
}

func TestManyPoolsRunEachJobOnce(t *testing.T) {
	t.Parallel()
	const jobs = 3000
	db := pgtest.Pool(t)
	var runs sync.Map
	var total atomic.Int64
	h := pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
		n, _ := runs.LoadOrStore(j.ID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		total.Add(1)
		return nil
	})
	evs := make(events, jobs)
	params := make([]pool.InsertManyParams, jobs)
	for i := range params {
		params[i] = pool.InsertManyParams{Kind: "count", Payload: map[string]int{"i": i}}
	}
	if _, err := pool.InsertMany(context.Background(), db, params); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		cfg := fastConfig()
		cfg.ID = fmt.Sprintf("w%d", i)
		cfg.Observer = evs
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"count": h})
		start(t, p)
	}
	evs.wait(t, jobs, 60*time.Second)
	if total.Load() != jobs {
		t.Fatalf("%d executions for %d jobs", total.Load(), jobs)
	}
	runs.Range(func(k, v any) bool {
		if n := v.(*atomic.Int32).Load(); n != 1 {
			t.Errorf("job %v ran %d times", k, n)
		}
		return true
	})
	var done int
	db.QueryRow(context.Background(), "SELECT count(*) FROM leash.jobs WHERE state = 'completed' AND attempt = 1").Scan(&done)
	if done != jobs {
		t.Fatalf("%d of %d jobs completed at attempt 1", done, jobs)
	}
}

func TestNotificationAloneStartsJob(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": noop()})
	start(t, p)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	// The first claim pass ran at start on an empty table; the next poll is a minute away, so
	// only the notification can start the job within the wait.
	insert(t, b.db, "noop", nil, nil)
	b.events.wait(t, 1, 20*time.Second)
}

// waitFor polls cond, for states that have no signal of their own.
func waitFor(t *testing.T, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s", timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestShutdownHandsBack(t *testing.T) {
	t.Parallel()
	started := make(chan struct{})
	var cause atomic.Value
	cfg := fastConfig()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"long": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		close(started)
		<-ctx.Done()
		cause.Store(context.Cause(ctx))
		return context.Cause(ctx)
	})})
	id := insert(t, b.db, "long", nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	p.Shutdown(ctx)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if c, _ := cause.Load().(error); !errors.Is(c, lease.ErrShutdown) {
		t.Fatalf("handler saw cause %v", c)
	}
	r := getRow(t, b.db, id)
	if r.State != "available" || r.Attempt != 0 || r.Token != nil || len(r.Errors) != 0 {
		t.Fatalf("row %+v", r)
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d stale writes", n)
	}
	if n := p.Stats().HandedBack; n != 1 {
		t.Fatalf("%d handed back", n)
	}
}

func TestShutdownWaitsForRunningJobs(t *testing.T) {
	t.Parallel()
	started := make(chan struct{})
	release := make(chan struct{})
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"wait": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		close(started)
		<-release
		return nil
	})})
	id := insert(t, b.db, "wait", nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-started
	stopped := make(chan struct{})
	go func() { p.Shutdown(context.Background()); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("Shutdown returned while a job was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-stopped
	<-done
	if r := getRow(t, b.db, id); r.State != "completed" {
		t.Fatalf("row %+v", r)
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cases := map[string]func() error{
		"empty kind":   func() error { _, err := pool.Insert(ctx, db, "", nil, nil); return err },
		"long kind":    func() error { _, err := pool.Insert(ctx, db, strings.Repeat("k", 129), nil, nil); return err },
		"chan payload": func() error { _, err := pool.Insert(ctx, db, "k", make(chan int), nil); return err },
		"invalid raw":  func() error { _, err := pool.Insert(ctx, db, "k", json.RawMessage("{nope"), nil); return err },
		"negative delay": func() error {
			_, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{Delay: -time.Second})
			return err
		},
		"max attempts": func() error { _, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{MaxAttempts: -1}); return err },
		"bulk one bad": func() error {
			_, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{{Kind: "k"}, {Kind: ""}})
			return err
		},
	}
	for name, f := range cases {
		if err := f(); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("%s: got %v, want ErrInvalidJob", name, err)
		}
	}
	var n int
	db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs").Scan(&n)
	if n != 0 {
		t.Fatalf("%d rows inserted by bad input", n)
	}
	for name, cfg := range map[string]pool.Config{
		"Concurrency":           {Concurrency: -1},
		"HeartbeatInterval":     {LeaseDuration: time.Second, HeartbeatInterval: 600 * time.Millisecond},
		"PollInterval":          {PollInterval: time.Millisecond},
		"Queues":                {Queues: []string{""}},
		"Engine.ClaimsInFlight": {Engine: pool.EngineConfig{ClaimsInFlight: 3}}, // needs ControlConns 5
		"Engine.ClaimGather":    {Engine: pool.EngineConfig{ClaimGather: 2 * time.Second}},
	} {
		_, err := pool.New(db, cfg)
		var ce *pool.ConfigError
		if !errors.As(err, &ce) || ce.Field != name {
			t.Errorf("config %s: got %v", name, err)
		}
	}
	if _, err := pool.New(db, pool.Config{Engine: pool.EngineConfig{ClaimsInFlight: 3}, ControlConns: 5}); err != nil {
		t.Errorf("three claims in flight on five control connections: %v", err)
	}
}

func TestInsertTxVisibleOnCommitOnly(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id, err := pool.InsertTx(ctx, tx, "k", map[string]string{"a": "b"}, &pool.InsertOpts{Queue: "q"})
	if err != nil {
		t.Fatal(err)
	}
	tx.Rollback(ctx)
	var n int
	db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE id = $1", id).Scan(&n)
	if n != 0 {
		t.Fatal("rolled back insert is visible")
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		id, err = pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{Queue: "q"})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var q string
	db.QueryRow(ctx, "SELECT queue FROM leash.jobs WHERE id = $1", id).Scan(&q)
	if q != "q" {
		t.Fatalf("queue %q", q)
	}
}

func TestRetention(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
		INSERT INTO leash.jobs (kind, state, finished_at)
		SELECT 'k', s, now() - age
		FROM (VALUES ('completed', interval '2 days'), ('completed', interval '1 hour'),
		             ('failed', interval '8 days'), ('failed', interval '2 days'),
		             ('cancelled', interval '8 days')) AS v(s, age),
		     generate_series(1, 1500)`)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := setup(t, db, fastConfig(), nil)
	n, err := p.PruneOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 4500 {
		t.Fatalf("deleted %d, want 4500", n)
	}
	var left int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs`).Scan(&left)
	if left != 3000 {
		t.Fatalf("%d left, want 3000", left)
	}
	cfg := fastConfig()
	cfg.RetainCompleted, cfg.RetainFailed = -1, time.Hour
	keep, _ := setup(t, db, cfg, nil)
	if n, err := keep.PruneOnce(ctx); err != nil || n != 1500 {
		t.Fatalf("deleted %d, %v; want only the 1500 failed", n, err)
	}
}

// A handler that ignores cancellation cannot hold shutdown hostage: its job is handed back, and
// what it returns later is dropped.
// A handler that ignores cancellation at shutdown is not handed back (another worker would run
// the job beside it): its lease is left to expire, a rescuer takes the job back, and its late
// result is dropped.
func TestShutdownAbandonsStalledHandlerToItsLease(t *testing.T) {
	t.Parallel()
	started, release, returned := make(chan struct{}), make(chan struct{}), make(chan struct{})
	cfg := fastConfig()
	cfg.ShutdownStallWait = 50 * time.Millisecond
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"deaf": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		close(started)
		<-release
		defer close(returned)
		return nil
	})})
	id := insert(t, b.db, "deaf", nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-started
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a hard stop
	p.Shutdown(ctx)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	r := getRow(t, b.db, id)
	if r.State != "running" || r.Attempt != 1 || r.Token == nil {
		t.Fatalf("abandoned job %+v, want still running under its lease", r)
	}
	if n := p.Stats().Abandoned; n != 1 {
		t.Fatalf("%d abandoned", n)
	}
	waitFor(t, 10*time.Second, func() bool {
		got, err := (&leasekeeper.Rescuer{DB: b.db, Interval: time.Hour}).RunOnce(context.Background())
		return err == nil && len(got) == 1
	})
	close(release)
	<-returned
	if r := getRow(t, b.db, id); r.State != "retryable" || r.Attempt != 1 {
		t.Fatalf("after rescue and the late return: %+v", r)
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d stale writes", n)
	}
}

func TestDefaultRetryBackoff(t *testing.T) {
	t.Parallel()
	prev := time.Duration(0)
	for attempt := 1; attempt <= 25; attempt++ {
		d := pool.DefaultRetryBackoff(attempt)
		base := min(time.Duration(1<<min(attempt-1, 30))*time.Second, 6*time.Hour)
		if d < base || d > base+base/4 {
			t.Fatalf("attempt %d: %s outside [%s, %s]", attempt, d, base, base+base/4)
		}
		if attempt <= 15 && d <= prev/2 {
			t.Fatalf("attempt %d: %s does not grow from %s", attempt, d, prev)
		}
		prev = d
	}
}

// A failed attempt is scheduled after the configured backoff, on the database clock.
func TestRetryScheduledAfterBackoff(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.RetryBackoff = func(attempt int) time.Duration { return time.Duration(attempt) * time.Hour }
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"fail": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		return errors.New("no")
	})})
	id := insert(t, b.db, "fail", nil, nil)
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	var hours float64
	b.db.QueryRow(context.Background(), `SELECT extract(epoch FROM run_at - attempted_at) / 3600 FROM leash.jobs WHERE id = $1`, id).Scan(&hours)
	if r := getRow(t, b.db, id); r.State != "retryable" || hours < 0.99 || hours > 1.01 {
		t.Fatalf("row %+v, retry in %.3fh", r, hours)
	}
}
