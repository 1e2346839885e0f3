package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/pool"
)

// A job whose lease ended before shutdown (its timeout) and whose handler ignores it is
// abandoned when the pool stops: Shutdown must not report a clean stop.
func TestShutdownReportsAbandonedJobWhoseLeaseEndedEarlier(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}, 1), make(chan struct{})
	t.Cleanup(func() { close(release) })
	cfg := fastConfig()
	cfg.ShutdownStallWait = 100 * time.Millisecond
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"deaf": pool.HandlerFunc(func(ctx context.Context, _ *pool.Job) error {
		started <- struct{}{}
		<-release // ignores its context: the timeout, then shutdown
		return nil
	})})
	insert(t, b.db, "deaf", nil, &pool.InsertOpts{Timeout: 50 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-started
	waitFor(t, 10*time.Second, func() bool { return p.Stats().TimedOut == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := p.Shutdown(ctx)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if p.Stats().Abandoned != 1 {
		t.Fatalf("abandoned %d, want 1", p.Stats().Abandoned)
	}
	if !errors.Is(err, pool.ErrJobsCancelled) {
		t.Fatalf("Shutdown after abandoning a running handler: %v, want ErrJobsCancelled", err)
	}
}

// foreverObserver blocks in JobFinished until release is closed, and counts the calls.
type foreverObserver struct {
	release chan struct{}
	calls   atomic.Int64
}

func (o *foreverObserver) JobFinished(pool.JobEvent) { o.calls.Add(1); <-o.release }

// An Observer that blocks does not hold Shutdown past its context by Config.ShutdownTimeout:
// "a ctx that is already done stops at once".
func TestShutdownNotHeldByBlockedObserver(t *testing.T) {
	t.Parallel()
	obs := &foreverObserver{release: make(chan struct{})}
	t.Cleanup(func() { close(obs.release) })
	cfg := fastConfig()
	cfg.Observer = obs
	cfg.ShutdownTimeout = time.Minute
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": noop()})
	insert(t, b.db, "noop", nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	waitFor(t, 10*time.Second, func() bool { return obs.calls.Load() == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	began := time.Now()
	if err := p.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Fatalf("Shutdown with a 100ms context took %s behind a blocked Observer", took)
	}
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// Events the Observer did not take before Run gave up on it are dropped and counted, never
// delivered after Run returned.
func TestObserverEventsNotDeliveredAfterRunReturned(t *testing.T) {
	t.Parallel()
	obs := &foreverObserver{release: make(chan struct{})}
	cfg := fastConfig()
	cfg.Observer = obs
	cfg.ShutdownTimeout = 200 * time.Millisecond
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": noop()})
	for range 3 {
		insert(t, b.db, "noop", nil, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	waitFor(t, 10*time.Second, func() bool {
		var n int
		b.db.QueryRow(context.Background(), `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`).Scan(&n)
		return n == 3
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got := p.Stats().EventsDropped; got != 2 {
		t.Fatalf("EventsDropped after Run returned = %d, want the 2 events the Observer never took", got)
	}
	close(obs.release)
	if got := obs.calls.Load(); got != 1 {
		t.Fatalf("the Observer was called %d times", got)
	}
}

type nullablePtr struct{ N int }

func (*nullablePtr) Kind() string { return "nullable_ptr" }

// AddWorker with a pointer type promises "a pointer to a fresh T", also for a payload of JSON
// null (a nil *T with a pointer-receiver Kind inserts one, and so can SQL).
func TestPointerArgsNullPayload(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), nil)
	var gotNil atomic.Bool
	if err := pool.AddWorker(p, func(_ context.Context, _ *pool.Job, a *nullablePtr) error {
		gotNil.Store(a == nil)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	id, err := pool.InsertArgs(context.Background(), b.db, (*nullablePtr)(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	start(t, p)
	ev := b.events.wait(t, 1, 10*time.Second)[0]
	if gotNil.Load() || ev.State != "completed" {
		t.Fatalf("handler got a nil *T for job %d: event %+v (err %v)", id, ev, ev.Err)
	}
}

// Args fails a payload that is more than one JSON value, whatever follows the first.
func TestArgsRejectsTrailingData(t *testing.T) {
	t.Parallel()
	h := pool.Args(func(context.Context, *pool.Job, struct{ A int }) error { return nil })
	for _, payload := range []string{`{"A":1}}`, `{"A":1}]`, `{"A":1} {}`, `{"A":1} x`} {
		if err := h.Handle(context.Background(), &pool.Job{Payload: json.RawMessage(payload)}); !pool.IsPermanent(err) {
			t.Errorf("payload %s: %v, want a permanent error", payload, err)
		}
	}
}

type emptyKind struct{}

func (emptyKind) Kind() string { return "" }

type panicKind struct{}

func (panicKind) Kind() string { panic("no kind") }

// KindOf names no kind for an interface type, a Kind that panics or one that returns "".
func TestKindOfHostileTypes(t *testing.T) {
	t.Parallel()
	if k, err := pool.KindOf[pool.JobArgs](); err == nil {
		t.Errorf("KindOf[JobArgs] = %q", k)
	}
	if k, err := pool.KindOf[emptyKind](); err == nil {
		t.Errorf("KindOf[emptyKind] = %q", k)
	}
	if k, err := pool.KindOf[*panicKind](); err == nil {
		t.Errorf("KindOf[*panicKind] = %q", k)
	}
}

// A handler that scribbles over its Job (payload bytes, trace context, output after it
// returned) changes nothing leash writes, and Register racing Run is no data race.
func TestHandlerScribblingAfterReturn(t *testing.T) {
	t.Parallel()
	late := make(chan *pool.Job, 1)
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"scribble": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
		for i := range j.Payload {
			j.Payload[i] = ' '
		}
		j.TraceContext = map[string]string{"traceparent": "x"}
		if err := j.SetOutput("kept"); err != nil {
			return err
		}
		late <- j
		return nil
	})})
	id := insert(t, b.db, "scribble", map[string]int{"n": 1}, nil)
	registered := make(chan error, 1)
	go func() { registered <- p.Register("late", noop()) }()
	start(t, p)
	<-registered // nil or ErrStarted, whichever came first
	ev := b.events.wait(t, 1, 10*time.Second)[0]
	j := <-late
	if err := j.SetOutput("too late"); err != nil {
		t.Fatal(err)
	}
	var out string
	if err := b.db.QueryRow(context.Background(), `SELECT output #>> '{}' FROM leash.jobs WHERE id = $1`, id).Scan(&out); err != nil {
		t.Fatal(err)
	}
	if ev.State != "completed" || out != "kept" {
		t.Fatalf("event %+v, output %q", ev, out)
	}
	var n int
	if err := b.db.QueryRow(context.Background(), `SELECT (payload->>'n')::int FROM leash.jobs WHERE id = $1`, id).Scan(&n); err != nil || n != 1 {
		t.Fatalf("payload n = %d, %v", n, err)
	}
}
