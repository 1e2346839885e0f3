package pool

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/internal/leasekeeper"
)

// AttemptHook wraps every attempt of every job; set it in Config.Hooks. It is how tracing
// (module github.com/leashq/leash/otel) and similar instrumentation plug into a Pool without
// package pool depending on them.
//
// For each attempt the pool calls StartAttempt on the attempt's goroutine, just before the
// handler runs. The AttemptObserver it returns is then told, from whichever goroutine sees it
// first:
//
//   - LeaseEnded, at most once, if the attempt's lease ends before the attempt is settled: a
//     revocation or a lease loss reaching the job, its renewal timing out, shutdown or its
//     timeout cancelling it;
//   - AttemptEnded, exactly once and last, when the attempt is settled: its outcome written or
//     rejected by the fence, nothing written because the lease was lost, or the handler
//     abandoned at shutdown.
type AttemptHook interface {
	// StartAttempt is called with the handler's context and the attempt's job (ID, Kind, Queue,
	// Attempt, Token, TraceContext, ...; read it, do not change it). It returns the context the
	// handler runs with, which must be ctx or derived from it (ctx carries the lease's
	// cancellation and the values Logger reads), and the attempt's observer, or nil when it
	// wants to hear no more of this attempt.
	StartAttempt(ctx context.Context, job *Job) (context.Context, AttemptObserver)
}

// AttemptObserver follows one attempt after its AttemptHook started it. Its methods are called
// on the pool's own goroutines (the listener's, the lease keeper's, the outcome writer's),
// possibly while the handler still runs: they must be safe for concurrent use and must not
// block. LeaseEnded is never called after AttemptEnded.
type AttemptObserver interface {
	// LeaseEnded reports the cause the handler's context was just cancelled with:
	// lease.ErrRevoked, lease.ErrLost, lease.ErrRenewalTimeout, lease.ErrShutdown or ErrTimeout
	// (match with errors.Is; a revocation's error text carries its reason).
	LeaseEnded(cause error)
	// AttemptEnded reports how the attempt was settled: State is the state written ("" when
	// nothing was), Stale that the fence rejected it, Err what the handler returned, Cause the
	// lease's end cause, Abandoned that the pool stopped without the handler.
	AttemptEnded(ev JobEvent)
}

// AttemptHookFunc adapts a function to AttemptHook.
type AttemptHookFunc func(ctx context.Context, job *Job) (context.Context, AttemptObserver)

// StartAttempt calls f(ctx, job).
func (f AttemptHookFunc) StartAttempt(ctx context.Context, job *Job) (context.Context, AttemptObserver) {
	return f(ctx, job)
}

// attemptState holds one attempt's observers and keeps their calls in order: LeaseEnded at most
// once, AttemptEnded once and last.
type attemptState struct {
	log *slog.Logger

	mu        sync.Mutex
	observers []AttemptObserver
	leaseDone bool
	ended     bool
}

// runAttempt runs the handler of j under ctx, with the attempt's values attached (Logger) and
// the Config.Hooks started, and records what the handler returned for the observers.
func (p *Pool) runAttempt(ctx context.Context, j *Job) error {
	j.info = attemptInfo{job: j, base: p.log}
	j.ctx = attemptCtx{Context: ctx, info: &j.info}
	ctx = &j.ctx
	if len(p.cfg.Hooks) > 0 {
		ctx = p.startHooks(ctx, j)
	}
	j.err = p.call(ctx, j)
	return j.err
}

// startHooks starts every hook on j and registers the observers they return, so that the
// lease's end and the attempt's settlement reach them.
func (p *Pool) startHooks(ctx context.Context, j *Job) context.Context {
	st := &attemptState{log: p.log}
	for _, h := range p.cfg.Hooks {
		var obs AttemptObserver
		ctx, obs = p.startHook(ctx, h, j)
		if obs != nil {
			st.observers = append(st.observers, obs)
		}
	}
	if len(st.observers) == 0 {
		return ctx
	}
	p.attempts.Store(j.claim.Token, st)
	// The lease may have ended before the attempt was registered (a timeout, a revocation or
	// shutdown that came first); leaseEnded may also have seen it: st reports it once.
	if cause := j.lease.Cause(); cause != nil {
		st.leaseEnded(j, cause)
	}
	return ctx
}

// startHook calls h, treating a hook that panics as one that returned nothing: instrumentation
// must never stop a job.
func (p *Pool) startHook(ctx context.Context, h AttemptHook, j *Job) (out context.Context, obs AttemptObserver) {
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("attempt hook panicked; running the job without it", slog.Int64("job_id", j.claim.ID),
				slog.String("panic", clean.Text(describe(r), 1024)))
			out, obs = ctx, nil
		}
	}()
	out, obs = h.StartAttempt(ctx, j)
	if out == nil {
		out = ctx
	}
	return out, obs
}

// leaseEnded is the keeper's OnEnd: it tells the observers of the lease's attempt, if any.
func (p *Pool) leaseEnded(l *leasekeeper.Lease, cause error) {
	if v, ok := p.attempts.Load(l.Token); ok {
		st := v.(*attemptState)
		st.leaseEnded(nil, cause)
	}
}

// endAttempt tells the observers of j's attempt how it was settled.
func (p *Pool) endAttempt(j *Job, ev JobEvent) {
	if len(p.cfg.Hooks) == 0 {
		return
	}
	v, ok := p.attempts.LoadAndDelete(j.claim.Token)
	if !ok {
		return
	}
	v.(*attemptState).attemptEnded(j, ev)
}

// abandonAttempt settles the observers of an attempt whose handler the pool stops without.
func (p *Pool) abandonAttempt(j *Job) {
	p.endAttempt(j, JobEvent{Queue: j.claim.Queue, Kind: j.claim.Kind, Duration: time.Since(j.started), Pickup: j.pickup(),
		Cause: j.lease.Cause(), Abandoned: true})
}

func (st *attemptState) leaseEnded(j *Job, cause error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.leaseDone || st.ended {
		return
	}
	st.leaseDone = true
	for _, o := range st.observers {
		st.safely(j, func() { o.LeaseEnded(cause) })
	}
}

func (st *attemptState) attemptEnded(j *Job, ev JobEvent) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.ended {
		return
	}
	if ev.Cause != nil && !st.leaseDone {
		// The lease ended in a way the keeper did not report (or not yet): tell it first.
		st.leaseDone = true
		for _, o := range st.observers {
			st.safely(j, func() { o.LeaseEnded(ev.Cause) })
		}
	}
	st.ended = true
	for _, o := range st.observers {
		st.safely(j, func() { o.AttemptEnded(ev) })
	}
}

// safely runs an observer's call, logging rather than spreading a panic.
func (st *attemptState) safely(j *Job, f func()) {
	defer func() {
		if r := recover(); r != nil {
			attrs := []any{slog.String("panic", clean.Text(describe(r), 1024))}
			if j != nil {
				attrs = append(attrs, slog.Int64("job_id", j.claim.ID))
			}
			st.log.Error("attempt observer panicked", attrs...)
		}
	}()
	f()
}
