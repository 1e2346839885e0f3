package pool

import (
	"cmp"
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/leashq/leash/internal/store"
)

// claimLoop claims up to the number of free slots whenever woken, until ctx is done.
func (p *Pool) claimLoop(ctx context.Context) {
	poll := time.NewTimer(p.jitteredPoll())
	defer poll.Stop()
	moreLikely := true // the last claim filled every slot it asked for
	for {
		free := p.cfg.Concurrency - int(p.active.Load())
		if free > 0 && p.keeper.Healthy() {
			n, err := p.claim(ctx, free)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				p.log.WarnContext(ctx, "claiming jobs failed", slog.Any("err", err))
				moreLikely = false
			} else {
				moreLikely = n == free
				if moreLikely {
					continue
				}
			}
		}
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				return
			case <-p.wake:
				waiting = false
			case <-p.slotWake:
				waiting = !moreLikely
			case <-poll.C:
				poll.Reset(p.jitteredPoll())
				waiting = false
			}
		}
	}
}

func (p *Pool) jitteredPoll() time.Duration {
	d := p.cfg.PollInterval
	return d - d/10 + time.Duration(rand.Int64N(int64(d)/5+1))
}

// claim leases up to limit jobs in one statement and starts them. The statement is not cut short
// by ctx: jobs it claims are always started (and handed back on shutdown), never stranded.
func (p *Pool) claim(ctx context.Context, limit int) (int, error) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	sentAt := time.Now()
	jobs, err := store.Claim(sctx, p.control(), store.ClaimParams{Queues: p.cfg.Queues, Limit: limit,
		WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration})
	if err != nil {
		return 0, err
	}
	p.metrics.Claimed.Add(int64(len(jobs)))
	for i := range jobs {
		p.start(&jobs[i], sentAt)
	}
	return len(jobs), nil
}

func (p *Pool) start(cj *store.ClaimedJob, sentAt time.Time) {
	ctx, l := p.keeper.Hold(p.jobsCtx, cj.ID, cj.Token, sentAt)
	j := &Job{ID: cj.ID, Queue: cj.Queue, Kind: cj.Kind, Payload: cj.Payload, Priority: cj.Priority,
		Attempt: int(cj.Attempt), MaxAttempts: int(cj.MaxAttempts), Token: cj.Token, CreatedAt: cj.CreatedAt,
		RunAt: cj.RunAt, AttemptedAt: cj.AttemptedAt, lease: l, db: p.db, started: time.Now()}
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
