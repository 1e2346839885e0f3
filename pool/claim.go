package pool

import (
	"cmp"
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/leashq/leash/internal/store"
)

// claimLoop claims up to the number of free slots until ctx is done. While work flows it claims
// again at once; after an empty claim it polls every IdlePollInterval; once it has found nothing
// for WaitAfter it registers as waiting (so that inserts notify it), claims once more to close the
// race with an insert that committed unseen, and then waits for a notification, a freed slot or
// the PollInterval poll, which bounds that race. It unregisters as soon as it finds work again.
func (p *Pool) claimLoop(ctx context.Context) {
	poll := time.NewTimer(p.jitteredPoll())
	defer poll.Stop()
	idle := time.NewTimer(time.Hour)
	idle.Stop()
	defer idle.Stop()
	w := &waiting{p: p}
	defer w.unregister()
	var idleSince time.Time // zero while work flows
	for {
		free := p.cfg.Concurrency - int(p.active.Load())
		full, failed := free <= 0, false
		if !full && p.keeper.Healthy() {
			n, err := p.claim(ctx, free)
			switch {
			case err != nil:
				if ctx.Err() != nil {
					return
				}
				p.log.WarnContext(ctx, "claiming jobs failed", slog.Any("err", err))
				failed = true
			case n > 0:
				idleSince = time.Time{}
				w.unregister()
				full = n == free
				if !full {
					continue // more may be there: claim again at once
				}
			case idleSince.IsZero():
				idleSince = time.Now()
			}
		}
		if !full && !failed && !idleSince.IsZero() && !w.registered && time.Since(idleSince) >= p.cfg.WaitAfter {
			if w.register(ctx) {
				continue // claim once more: an insert that did not see the registration is found now
			}
		}
		quick := !full && !failed && !w.registered && !idleSince.IsZero()
		if quick {
			idle.Reset(p.cfg.IdlePollInterval)
		}
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				return
			case <-p.wake:
				waiting = false
			case <-p.slotWake:
				waiting = false
			case <-idle.C:
				waiting = false
			case <-poll.C:
				poll.Reset(p.jitteredPoll())
				if w.registered {
					w.register(ctx) // refresh before it expires
				}
				waiting = false
			}
		}
		if quick {
			idle.Stop()
		}
	}
}

// waiting is the claim loop's registration as a worker waiting for work.
type waiting struct {
	p          *Pool
	registered bool
}

// register records (or refreshes) the registration; false when it could not.
func (w *waiting) register(ctx context.Context) bool {
	p := w.p
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// Expires three polls from now: refreshed at every poll while waiting, gone soon after the
	// worker is.
	err := store.RegisterWaiter(sctx, p.control(), p.waiterID, p.cfg.Queues, 3*p.cfg.PollInterval+time.Second)
	if err != nil {
		if ctx.Err() == nil {
			p.log.WarnContext(ctx, "registering as waiting for work failed; polling instead", slog.Any("err", err))
		}
		return false
	}
	w.registered = true
	return true
}

// unregister removes the registration, if any: a busy worker needs no wake-up.
func (w *waiting) unregister() {
	if !w.registered {
		return
	}
	w.registered = false
	p := w.p
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := store.UnregisterWaiter(ctx, p.control(), p.waiterID); err != nil {
		// It expires on its own; meanwhile inserts notify a worker that is busy, which is harmless.
		p.log.Warn("unregistering as waiting for work failed", slog.Any("err", err))
	}
}

func (p *Pool) jitteredPoll() time.Duration {
	d := p.cfg.PollInterval
	return d - d/10 + time.Duration(rand.Int64N(int64(d)/5+1))
}

// claim leases up to limit jobs in one statement and starts them. With OutcomesWithClaims,
// outcomes waiting to be written ride along: they are written in the same transaction, one
// commit for both. The statement is
// not cut short by ctx: jobs it claims are always started (and handed back on shutdown), never
// stranded.
func (p *Pool) claim(ctx context.Context, limit int) (int, error) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	params := store.ClaimParams{Queues: p.cfg.Queues, Limit: limit, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}
	var items []finishItem
	if p.cfg.OutcomesWithClaims {
		items = p.takeOutcomes()
	}
	sentAt := time.Now()
	var jobs []store.ClaimedJob
	var err error
	if len(items) == 0 {
		jobs, err = store.Claim(sctx, p.control(), params)
	} else {
		outs := make([]store.Outcome, len(items))
		for i := range items {
			outs[i] = items[i].out
		}
		var ws []store.Written
		ws, jobs, err = store.FinishAndClaim(sctx, controlDB{p}, outs, params)
		if err != nil {
			// Neither statement committed: write the outcomes the usual way (retried, split
			// when the database refuses one), then report the claim's failure.
			p.flush(items)
			return 0, err
		}
		written := make(map[int64]string, len(ws))
		for _, w := range ws {
			written[w.ID] = w.State
		}
		p.settleAll(items, written)
	}
	if err != nil {
		return 0, err
	}
	p.metrics.Claimed.Add(int64(len(jobs)))
	for i := range jobs {
		p.start(&jobs[i], sentAt)
	}
	return len(jobs), nil
}

// takeOutcomes takes the outcomes waiting for the finisher, without waiting.
func (p *Pool) takeOutcomes() []finishItem {
	var items []finishItem
	for len(items) < FinishBatchDefault {
		select {
		case it := <-p.finishCh:
			items = append(items, it)
		default:
			return items
		}
	}
	return items
}

func (p *Pool) start(cj *store.ClaimedJob, sentAt time.Time) {
	ctx, l := p.keeper.Hold(p.jobsCtx, cj.ID, cj.Token, sentAt)
	j := &Job{ID: cj.ID, Queue: cj.Queue, Kind: cj.Kind, Payload: cj.Payload, Priority: cj.Priority,
		Attempt: int(cj.Attempt), MaxAttempts: int(cj.MaxAttempts), Token: cj.Token, CreatedAt: cj.CreatedAt,
		RunAt: cj.RunAt, AttemptedAt: cj.AttemptedAt, lease: l, db: p.db, started: time.Now(),
		TraceContext: decodeTraceContext(cj.TraceContext)}
	if d := cmp.Or(cj.Timeout, p.cfg.Timeouts[cj.Kind]); d > 0 {
		// Ends the lease: the handler's context is cancelled with the timeout, and the lease is
		// no longer renewed, so a handler that ignores it is settled by a rescuer.
		j.timer = time.AfterFunc(d, func() {
			if l.End(&timeoutError{d}) {
				p.metrics.TimedOut.Add(1)
				p.log.Warn("job timed out; cancelling", slog.Int64("job_id", j.ID), slog.String("kind", j.Kind),
					slog.Duration("timeout", d))
			}
		})
	}
	p.runningMu.Lock()
	p.running[j.Token] = j
	p.runningMu.Unlock()
	p.active.Add(1)
	p.outcomes.Add(1)
	if p.startObs != nil {
		p.startObs.JobStarted(JobEvent{Queue: j.Queue, Kind: j.Kind, State: store.StateRunning, Pickup: j.pickup()})
	}
	p.group.Go(func() error {
		defer func() {
			p.active.Add(-1)
			p.poke(p.slotWake)
		}()
		p.execute(ctx, j)
		return nil
	})
}

// forget ends the job's supervision: no more renewals, no timeout.
func (p *Pool) forget(j *Job) {
	if j.timer != nil {
		j.timer.Stop()
	}
	p.runningMu.Lock()
	if p.running[j.Token] == j {
		delete(p.running, j.Token)
	}
	p.runningMu.Unlock()
	p.keeper.Release(j.lease)
}
