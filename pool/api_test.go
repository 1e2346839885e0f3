package pool_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// A handler that rewrites every field of its Job changes only its own copy: the outcome is
// fenced with the claim's real token, the attempt counts as the row's, and the events name the
// real kind and queue.
func TestHandlerChangingJobFieldsChangesNothing(t *testing.T) {
	t.Parallel()
	scribble := func(j *pool.Job) {
		j.ID, j.Token, j.Attempt, j.MaxAttempts = 0, 12345, 99, 1
		j.Kind, j.Queue, j.Payload = "other", "elsewhere", nil
		j.CreatedAt, j.RunAt, j.AttemptedAt = time.Time{}, time.Time{}, time.Time{}
	}
	cfg := fastConfig()
	cfg.RetryBackoff = func(int) time.Duration { return time.Hour }
	p, b := setup(t, nil, cfg, map[string]pool.Handler{
		"ok": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error { scribble(j); return nil }),
		"err": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
			scribble(j)
			return errors.New("try again")
		}),
	})
	done := insert(t, b.db, "ok", nil, nil)
	retried := insert(t, b.db, "err", nil, nil)
	start(t, p)
	for _, ev := range b.events.wait(t, 2, 10*time.Second) {
		if ev.Queue != pool.QueueDefault || (ev.Kind != "ok" && ev.Kind != "err") || ev.Stale {
			t.Fatalf("event %+v", ev)
		}
	}
	if r := getRow(t, b.db, done); r.State != "completed" {
		t.Fatalf("completed job %+v", r)
	}
	if r := getRow(t, b.db, retried); r.State != "retryable" || r.Attempt != 1 {
		t.Fatalf("retried job %+v", r)
	}
	if s := p.Stats(); s.StaleWrites != 0 || s.Completed != 1 || s.Retried != 1 {
		t.Fatalf("stats %+v", s)
	}
}

type ptrArgs struct{ N int }

func (ptrArgs) Kind() string { return "ptr_args" }

type ptrKind struct{ N int }

func (*ptrKind) Kind() string { return "ptr_kind" }

// Args types may be pointers, with Kind on the value or on the pointer; a nil pointer given to
// InsertArgs is an invalid job, never a panic.
func TestPointerArgs(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), nil)
	var sum atomic.Int64
	if err := pool.AddWorker(p, func(_ context.Context, _ *pool.Job, a *ptrArgs) error { sum.Add(int64(a.N)); return nil }); err != nil {
		t.Fatal(err)
	}
	if err := pool.AddWorker(p, func(_ context.Context, _ *pool.Job, a *ptrKind) error { sum.Add(int64(a.N)); return nil }); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := pool.InsertArgs(ctx, b.db, (*ptrArgs)(nil), nil); !errors.Is(err, pool.ErrInvalidJob) {
		t.Fatalf("nil *ptrArgs: %v", err)
	}
	for _, a := range []pool.JobArgs{&ptrArgs{N: 3}, &ptrKind{N: 4}} {
		if _, err := pool.InsertArgs(ctx, b.db, a, nil); err != nil {
			t.Fatal(err)
		}
	}
	start(t, p)
	b.events.wait(t, 2, 10*time.Second)
	if sum.Load() != 7 {
		t.Fatalf("handlers saw %d, want 7", sum.Load())
	}
	if k, err := pool.KindOf[*ptrKind](); k != "ptr_kind" || err != nil {
		t.Fatalf("KindOf[*ptrKind] = %q, %v", k, err)
	}
}

// blockingObserver blocks every JobFinished until release is closed.
type blockingObserver struct {
	release chan struct{}
	seen    atomic.Int64
}

func (o *blockingObserver) JobFinished(pool.JobEvent) { <-o.release; o.seen.Add(1) }

// An Observer that blocks delays only its own events: outcomes are written and new jobs start
// meanwhile, and the events arrive once it takes them.
func TestBlockingObserverStallsNothing(t *testing.T) {
	t.Parallel()
	obs := &blockingObserver{release: make(chan struct{})}
	cfg := fastConfig()
	cfg.Observer = obs
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": noop()})
	ids := make([]int64, 20)
	for i := range ids {
		ids[i] = insert(t, b.db, "noop", nil, nil)
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool {
		var n int
		b.db.QueryRow(context.Background(), `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`).Scan(&n)
		return n == len(ids)
	})
	if got := obs.seen.Load(); got != 0 {
		t.Fatalf("the Observer took %d events while blocked", got)
	}
	close(obs.release)
	waitFor(t, 10*time.Second, func() bool { return obs.seen.Load() == int64(len(ids)) })
}

// Shutdown says whether every running job finished on its own: nil when they did, an error
// matching ErrJobsCancelled when its context ended first and they were cancelled.
func TestShutdownReportsCancelledJobs(t *testing.T) {
	t.Parallel()
	started := make(chan struct{}, 1)
	cfg := fastConfig()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"wait": pool.HandlerFunc(func(ctx context.Context, _ *pool.Job) error {
		started <- struct{}{}
		<-ctx.Done()
		return context.Cause(ctx)
	})})
	id := insert(t, b.db, "wait", nil, nil)
	start(t, p)
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := p.Shutdown(ctx); !errors.Is(err, pool.ErrJobsCancelled) {
		t.Fatalf("Shutdown with a job running past its context: %v", err)
	}
	if ev := b.events.wait(t, 1, 10*time.Second)[0]; !errors.Is(ev.Cause, lease.ErrShutdown) {
		t.Fatalf("event %+v", ev)
	}
	if r := getRow(t, b.db, id); r.State != "available" {
		t.Fatalf("handed back job %+v", r)
	}

	other := fastConfig()
	other.Queues = []string{"other"}
	idle, _ := setup(t, b.db, other, map[string]pool.Handler{"noop": noop()})
	start(t, idle)
	if err := idle.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown of an idle pool: %v", err)
	}
}
