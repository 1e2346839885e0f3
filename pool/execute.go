package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
)

// execute runs the handler and queues its outcome. It never returns an error: a failing job is
// not a failing pool.
func (p *Pool) execute(ctx context.Context, j *Job) {
	err := stable(p.runAttempt(ctx, j))
	dur := time.Since(j.started)
	if j.timer != nil {
		j.timer.Stop() // the handler returned: a timeout must not end the lease of a finished attempt
	}
	if !j.lease.MarkFinishing() {
		// Abandoned at shutdown while this handler ignored its context; a rescuer settles it.
		p.log.Warn("handler returned after its job was abandoned at shutdown; result dropped",
			slog.Int64("job_id", j.claim.ID), slog.Any("err", err))
		return
	}
	defer p.outcomes.Done()
	out, write := p.decideSafely(j, err)
	out.Output = j.recordedOutput()
	if !write {
		p.log.Info("handler stopped after losing its lease", slog.Int64("job_id", j.claim.ID),
			slog.Int64("lease_token", j.claim.Token), slog.Any("err", err))
		p.observe(j, "", dur, false)
		p.forget(j)
		return
	}
	if out.State == store.StateCompleted && j.doneInTx.Load() {
		// The handler's own transaction wrote the completion (CompleteTx), with its effects. Writing
		// it again would complete the job without them if that transaction did not take (rolled
		// back, a savepoint with it rolled back, or undone by a failover to an asynchronous standby
		// that never received it, where the row is still running under this token). So the worker
		// writes a retry instead, fenced by the token like every outcome: a row the transaction
		// completed no longer holds it and is left as it is; a row still running under it runs
		// again at once, as after any lost attempt, rather than when its lease runs out.
		out, _ = p.decideSafely(j, errCompletionNotCommitted)
		out.Output = j.recordedOutput()
	}
	p.finishCh <- finishItem{out: out, job: j, dur: dur}
	p.poke(p.outcomeWake)
}

// errCompletionNotCommitted is the error of an attempt whose handler returned success after
// CompleteTx, when its transaction did not commit the completion.
var errCompletionNotCommitted = errors.New("the handler returned success, but the completion CompleteTx wrote in its transaction did not commit")

// decideSafely is decide, with anything a handler's error does to it (an Is or As method that
// panics) turned into a retryable failure rather than a dead worker.
func (p *Pool) decideSafely(j *Job, err error) (out store.Outcome, write bool) {
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("deciding a job's outcome panicked; retrying the job", slog.Int64("job_id", j.claim.ID),
				slog.String("panic", clean.Text(describe(r), 1024)))
			out, write = store.Outcome{ID: j.claim.ID, Token: j.claim.Token, State: store.StateRetryable,
				RunIn: p.cfg.RetryBackoff(int(j.claim.Attempt)), Error: &store.AttemptError{Attempt: int32(int(j.claim.Attempt)),
					Error: "the handler's error could not be examined: " + describe(r), Worker: p.cfg.ID}}, true
			if int(j.claim.Attempt) >= int(j.claim.MaxAttempts) {
				out.State, out.RunIn = store.StateFailed, 0
			}
		}
	}()
	return decide(j.claim.ID, j.claim.Token, p.cfg.ID, ending{err: err, cause: j.lease.Cause(), attempt: int(j.claim.Attempt),
		maxAttempts: int(j.claim.MaxAttempts), backoff: p.cfg.RetryBackoff})
}

func (p *Pool) call(ctx context.Context, j *Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			p.metrics.Panics.Add(1)
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
			p.log.Error("handler panicked", slog.Int64("job_id", j.claim.ID), slog.String("kind", j.claim.Kind),
				slog.String("panic", clean.Text(describe(r), 1024)))
		}
	}()
	p.handlersMu.RLock()
	h, ok := p.handlers[j.claim.Kind]
	p.handlersMu.RUnlock()
	if !ok {
		return fmt.Errorf("%w: kind %q on worker %s", ErrUnknownKind, j.claim.Kind, p.cfg.ID)
	}
	return h.Handle(ctx, j)
}

func (p *Pool) observe(j *Job, state string, dur time.Duration, stale bool) {
	ev := JobEvent{Queue: j.claim.Queue, Kind: j.claim.Kind, State: state, Duration: dur,
		Pickup: j.pickup(), Stale: stale, Err: j.err, Cause: j.lease.Cause()}
	p.endAttempt(j, ev)
	p.events.emit(false, ev)
}

// drain waits for running handlers until grace is done, then cancels them with ErrShutdown;
// their own outcomes hand the jobs back. A handler that still does not return is abandoned: its
// lease is no longer renewed and a rescuer takes the job back once it expires (the attempt
// counted, since it may still be doing the job's work). Handing it back at once would let
// another worker run it beside the one that never stopped.
//
// It returns how many running handlers the grace period's end cancelled, and how many of them
// were abandoned.
func (p *Pool) drain(grace context.Context) (cancelled, abandoned int) {
	all := make(chan struct{})
	go func() { p.group.Wait(); close(all) }()
	select {
	case <-all:
		return 0, 0
	case <-grace.Done():
	}
	p.runningMu.Lock()
	jobs := make([]*Job, 0, len(p.running))
	for _, j := range p.running {
		jobs = append(jobs, j)
	}
	p.runningMu.Unlock()
	if len(jobs) > 0 {
		p.log.Warn("shutdown: the grace period is over or was cut short; cancelling the running jobs", slog.Int("jobs", len(jobs)))
	}
	for _, j := range jobs {
		if !j.lease.Finishing() && j.lease.End(lease.ErrShutdown) {
			cancelled++
		}
	}
	select {
	case <-all:
		return cancelled, 0
	case <-time.After(p.cfg.ShutdownStallWait):
	}
	for _, j := range jobs {
		if !j.lease.MarkFinishing() {
			continue // it returned and queues its own outcome
		}
		abandoned++
		p.metrics.Abandoned.Add(1)
		p.log.Warn("handler ignores cancellation; abandoning its job to its lease, which a rescuer takes back when it expires",
			slog.Int64("job_id", j.claim.ID), slog.String("kind", j.claim.Kind), slog.Int64("lease_token", j.claim.Token))
		p.abandonAttempt(j)
		p.forget(j)
		p.outcomes.Done()
	}
	return cancelled, abandoned
}

// watchStalls logs, once per StallInterval, handlers that keep running after their lease ended:
// they keep their slot (a goroutine cannot be killed) but can no longer write.
func (p *Pool) watchStalls(ctx context.Context) {
	t := time.NewTicker(p.cfg.StallInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		var n int64
		p.runningMu.Lock()
		for _, j := range p.running {
			cause := j.lease.Cause()
			if cause == nil || j.lease.Finishing() {
				continue
			}
			if j.stallSeen.IsZero() {
				j.stallSeen = now
				continue
			}
			n++
			p.log.Warn("handler still running after its lease ended; it holds a slot but cannot write",
				slog.Int64("job_id", j.claim.ID), slog.String("kind", j.claim.Kind), slog.Any("cause", cause),
				slog.Duration("since", now.Sub(j.stallSeen)))
		}
		p.runningMu.Unlock()
		p.metrics.Stalled.Store(n)
	}
}
