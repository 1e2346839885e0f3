package pool

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leashq/leash/internal/store"
)

// finishItem is one job's outcome waiting to be written.
type finishItem struct {
	out store.Outcome
	job *Job
	dur time.Duration
}

// runFinisher writes the outcomes the claim loop has not taken along with a claim: an outcome
// waits at most FinishFlushInterval, then whatever is queued is written in one fenced statement.
// After stop it writes what is queued and returns; Run closes stop only once every outcome is
// queued.
func (p *Pool) runFinisher(stop <-chan struct{}) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case <-p.outcomeWake:
		case <-stop:
			for items := p.takeOutcomes(); len(items) > 0; items = p.takeOutcomes() {
				p.flush(items)
			}
			return
		}
		// Give the claim loop the flush interval to take them along; then write what is left.
		timer.Reset(p.cfg.FinishFlushInterval)
		select {
		case <-timer.C:
		case <-stop:
			timer.Stop()
		}
		for items := p.takeOutcomes(); len(items) > 0; items = p.takeOutcomes() {
			p.flush(items)
			if len(items) < FinishBatchDefault {
				break
			}
		}
	}
}

// flush writes a batch and settles every job in it.
func (p *Pool) flush(batch []finishItem) {
	written := make(map[int64]string, len(batch))
	p.write(batch, written, time.Now().Add(p.cfg.LeaseDuration))
	for _, it := range batch {
		state, ok := written[it.out.ID]
		p.settle(it, state, ok)
	}
}

// write stores items' outcomes, recording what was written. While the database is unreachable
// it retries (a fenced write is safe to repeat; a lease that expires meanwhile simply makes it
// write nothing) until deadline. When the database rejects the statement itself, one item's
// content is at fault: the batch is split in halves until the bad outcome is alone, so that one
// bad outcome never holds back or drops the others; that one is then written without its
// details, or given up to the rescuer.
func (p *Pool) write(items []finishItem, written map[int64]string, deadline time.Time) {
	backoff := 20 * time.Millisecond
	for {
		outs := make([]store.Outcome, len(items))
		for i := range items {
			outs[i] = items[i].out
		}
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ws, err := store.Finish(sctx, controlDB{p}, outs)
		cancel()
		if err == nil {
			for _, w := range ws {
				written[w.ID] = w.State
			}
			return
		}
		if rejected(err) {
			if len(items) > 1 {
				mid := len(items) / 2
				p.write(items[:mid], written, deadline)
				p.write(items[mid:], written, deadline)
				return
			}
			it := items[0]
			p.log.Error("database rejected a job outcome; writing it without its details",
				slog.Int64("job_id", it.job.ID), slog.String("outcome", it.out.State), slog.Any("err", err))
			if bare, ok := withoutDetails(it, err); ok {
				p.write([]finishItem{bare}, written, deadline)
			}
			return
		}
		if time.Now().After(deadline) {
			p.log.Error("giving up writing job outcomes; their leases have expired and rescuers will take the jobs back",
				slog.Any("err", err), slog.Int("jobs", len(items)))
			return
		}
		p.log.Warn("writing job outcomes failed; retrying", slog.Any("err", err), slog.Int("jobs", len(items)),
			slog.Duration("retry_in", backoff))
		time.Sleep(backoff)
		backoff = min(backoff*2, time.Second)
	}
}

// withoutDetails is the outcome with its error text replaced by a note of the rejection, and its
// revocation reason dropped: what remains is the state, which the database always takes. ok is
// false when there is nothing left to drop.
func withoutDetails(it finishItem, err error) (finishItem, bool) {
	var pe *pgconn.PgError
	errors.As(err, &pe)
	note := "outcome details could not be stored: " + pe.Code + " " + pe.Message
	changed := false
	if it.out.Error != nil && it.out.Error.Error != note {
		it.out.Error = &store.AttemptError{Attempt: it.out.Error.Attempt, Worker: it.out.Error.Worker, Error: note}
		changed = true
	}
	if it.out.Revoke != nil && *it.out.Revoke != "revoked" {
		r := "revoked"
		it.out.Revoke, changed = &r, true
	}
	return it, changed
}

// rejected reports whether the database refused the statement for what it carried (bad data,
// a constraint, a limit) rather than failing to run it (connection, shutdown, conflicts): the
// former fails the same way on every retry.
func rejected(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || len(pe.Code) < 2 {
		return false
	}
	switch pe.Code[:2] {
	case "22", "23", "42", "54", "P0", "XX", "2F", "38", "39":
		return true
	}
	return false
}

// settle ends the job's supervision once its outcome is written (or known to be unwritable).
func (p *Pool) settle(it finishItem, state string, written bool) {
	j := it.job
	stale := !written && !(j.doneInTx.Load() && it.out.State == store.StateCompleted)
	if stale {
		p.metrics.StaleWrites.Add(1)
		p.log.Warn("job outcome rejected: lease no longer held under this token; result dropped",
			slog.Int64("job_id", j.ID), slog.Int64("lease_token", j.Token), slog.String("outcome", it.out.State),
			slog.Any("lease_cause", j.lease.Cause()))
	} else {
		if !written {
			state = it.out.State
		}
		p.metrics.count(state)
	}
	if !written {
		state = it.out.State
	}
	p.observe(j, state, it.dur, stale)
	p.forget(j)
}
