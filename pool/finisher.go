package pool

import (
	"context"
	"log/slog"
	"time"

	"github.com/leashq/leash/internal/store"
)

// finishItem is one job's outcome waiting to be written.
type finishItem struct {
	out store.Outcome
	job *Job
	dur time.Duration
}

// finisher writes outcomes in batches: the first outcome waits at most FinishFlushInterval for
// others to join it, then one fenced statement writes them all.
func (p *Pool) runFinisher(stop <-chan struct{}) {
	defer close(p.finisherDone)
	batch := make([]finishItem, 0, FinishBatchDefault)
	for {
		select {
		case it := <-p.finishCh:
			batch = append(batch[:0], it)
		case <-stop:
			// Drain what is left, then stop.
			batch = batch[:0]
			for {
				select {
				case it := <-p.finishCh:
					batch = append(batch, it)
					if len(batch) == FinishBatchDefault {
						p.flush(batch)
						batch = batch[:0]
					}
				default:
					if len(batch) > 0 {
						p.flush(batch)
					}
					return
				}
			}
		}
		timer := time.NewTimer(p.cfg.FinishFlushInterval)
	gather:
		for len(batch) < FinishBatchDefault {
			select {
			case it := <-p.finishCh:
				batch = append(batch, it)
			case <-timer.C:
				break gather
			}
		}
		timer.Stop()
		p.flush(batch)
	}
}

// flush writes a batch, retrying while the database is unreachable: a fenced write is safe to
// repeat, and a lease that expires meanwhile simply makes it write nothing.
func (p *Pool) flush(batch []finishItem) {
	outs := make([]store.Outcome, len(batch))
	for i := range batch {
		outs[i] = batch[i].out
	}
	ctx := context.Background()
	var written []int64
	backoff := 20 * time.Millisecond
	deadline := time.Now().Add(p.cfg.LeaseDuration)
	for {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var err error
		written, err = store.Finish(sctx, p.db, outs)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			p.log.ErrorContext(ctx, "giving up writing job outcomes; their leases have expired and rescuers will take the jobs back",
				slog.Any("err", err), slog.Int("jobs", len(batch)))
			for _, it := range batch {
				p.release(it, false)
			}
			return
		}
		p.log.WarnContext(ctx, "writing job outcomes failed; retrying", slog.Any("err", err), slog.Int("jobs", len(batch)), slog.Duration("retry_in", backoff))
		time.Sleep(backoff)
		backoff = min(backoff*2, time.Second)
	}
	ok := make(map[int64]bool, len(written))
	for _, id := range written {
		ok[id] = true
	}
	for _, it := range batch {
		p.release(it, ok[it.out.ID])
	}
}

// release ends the job's supervision once its outcome is written (or known to be unwritable).
func (p *Pool) release(it finishItem, written bool) {
	j := it.job
	stale := !written && !(j.doneInTx.Load() && it.out.State == store.StateCompleted)
	if stale {
		p.metrics.StaleWrites.Add(1)
		p.log.Warn("job outcome rejected: lease no longer held under this token; result dropped",
			slog.Int64("job_id", j.ID), slog.Int64("lease_token", j.Token), slog.String("outcome", it.out.State),
			slog.Any("lease_cause", j.lease.Cause()))
	} else {
		p.metrics.count(it.out.State)
	}
	p.observe(j, it.out.State, it.dur, stale)
	p.keeper.Release(j.lease)
	p.forget(j)
}
