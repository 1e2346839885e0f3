package pool

import (
	"context"
	"errors"
	"log/slog"
	"slices"
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

// runFinisher writes outcomes (those the claim loop has not taken along with a claim, with
// OutcomesWithClaims): an outcome waits at most FinishFlushInterval, then whatever is queued is written in one fenced statement.
// Outcomes whose row another transaction holds are tried again, with backoff, for as long as
// their claim holds the job. After stop it writes what is queued, keeps trying the deferred ones
// for up to ShutdownTimeout, and returns; Run closes stop only once every outcome is queued.
func (p *Pool) runFinisher(stop <-chan struct{}) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	backoff := 50 * time.Millisecond
	sc := &finishScratch{}
	for {
		var retry <-chan time.Time
		if p.deferredCount() > 0 {
			retry = time.After(backoff)
		}
		select {
		case <-p.outcomeWake:
			// Let others join them for the flush interval (with OutcomesWithClaims, give the claim
			// loop that long to take them along); then write what is left.
			timer.Reset(p.cfg.Engine.FinishFlushInterval)
			select {
			case <-timer.C:
			case <-stop:
				timer.Stop()
			}
			p.flushQueued(sc)
		case <-retry:
			before := p.deferredCount()
			p.flush(p.takeDeferred(), sc)
			if p.deferredCount() < before {
				backoff = 50 * time.Millisecond
			} else {
				backoff = min(2*backoff, time.Second)
			}
		case <-stop:
			p.flushQueued(sc)
			deadline := time.Now().Add(p.cfg.ShutdownTimeout)
			for p.deferredCount() > 0 && time.Now().Before(deadline) {
				time.Sleep(backoff)
				p.flush(p.takeDeferred(), sc)
				backoff = min(2*backoff, time.Second)
			}
			for _, it := range p.takeDeferred() {
				p.giveUp(it, "its row stayed locked by another transaction through shutdown")
			}
			return
		}
	}
}

// finishScratch is what the finisher reuses from one batch to the next rather than allocate for
// each: the outcomes taken from finishCh, the rows of the statement's arrays and the states
// written. Only the finisher's goroutine uses it, and nothing keeps a reference into it past
// flush; it is cleared after each batch, so that no finished job stays reachable from it.
type finishScratch struct {
	items   []finishItem
	outs    []store.Outcome
	written map[int64]string
}

// outcomes is a slice of n outcomes to fill: sc's, or a new one when sc is nil.
func (sc *finishScratch) outcomes(n int) []store.Outcome {
	if sc == nil {
		return make([]store.Outcome, n)
	}
	sc.outs = slices.Grow(sc.outs[:0], n)[:n]
	return sc.outs
}

// writtenStates is an empty map for the states a batch of n writes: sc's, or a new one.
func (sc *finishScratch) writtenStates(n int) map[int64]string {
	if sc == nil {
		return make(map[int64]string, n)
	}
	if sc.written == nil {
		sc.written = make(map[int64]string, finishBatch)
	}
	clear(sc.written)
	return sc.written
}

// done drops what the last batch left in sc: every outcome its buffer held (a split batch
// leaves it shorter than what it filled), and the buffers themselves after a batch larger than
// finishBatch (outcomes deferred through an outage), so that one spike is not kept, nor cleared
// again at every batch, for the rest of the worker's life.
func (sc *finishScratch) done() {
	if sc == nil {
		return
	}
	if cap(sc.outs) > finishBatch {
		sc.outs = nil
	} else {
		clear(sc.outs[:cap(sc.outs)])
	}
	if len(sc.written) > finishBatch {
		sc.written = nil
	} else {
		clear(sc.written)
	}
}

// flushQueued writes every outcome queued for the finisher.
func (p *Pool) flushQueued(sc *finishScratch) {
	for {
		sc.items = p.appendOutcomes(sc.items[:0])
		if len(sc.items) == 0 {
			return
		}
		p.flush(sc.items, sc)
		clear(sc.items)
	}
}

// flush writes a batch and settles every job in it: written, fenced off (stale), or deferred when
// another transaction holds its row or the database cannot say. sc, when not nil, lends the
// batch's buffers (the finisher's).
func (p *Pool) flush(batch []finishItem, sc *finishScratch) {
	if len(batch) == 0 {
		return
	}
	defer sc.done()
	written := sc.writtenStates(len(batch))
	p.write(batch, written, sc)
	p.settleAll(batch, written)
	if len(written) > 0 && p.queues.anyCapped() {
		// A capped queue counts running rows: these were still running until now, so a claim
		// that found the queue full may find room.
		p.poke(p.wake)
	}
}

// settleAll settles every item of a batch: those in written (id -> state stored) as written,
// the others as settleMissing decides.
func (p *Pool) settleAll(items []finishItem, written map[int64]string) {
	var missing []finishItem
	var due map[time.Duration]bool // when the jobs made claimable again are due, to the millisecond
	for _, it := range items {
		if state, ok := written[it.out.ID]; ok {
			p.settle(it, state, true)
			if state == store.StateRetryable || state == store.StateAvailable {
				if due == nil {
					due = map[time.Duration]bool{}
				}
				due[(max(it.out.RunIn, 0) + time.Millisecond - 1).Truncate(time.Millisecond)] = true
			}
		} else {
			missing = append(missing, it)
		}
	}
	for in := range due {
		p.requeued(in)
	}
	p.settleMissing(missing)
}

// requeued wakes the claim loop for a job this pool has just made claimable again (a retry, a
// snooze, a hand-back) once it is due, in (from its write), when that is sooner than the next
// poll: no insert notifies anyone of it, and a claim loop waiting for wake-ups would otherwise
// leave it to the poll. in is the delay as the write stores it (rounded up to the millisecond);
// the wake comes a millisecond after it, never before the job is due.
func (p *Pool) requeued(in time.Duration) {
	switch {
	case in <= 0:
		p.poke(p.wake)
	case in < p.cfg.PollInterval:
		time.AfterFunc(in+time.Millisecond, func() { p.poke(p.wake) })
	}
}

// settleMissing settles outcomes a fenced write did not write: the claim lost the job (stale),
// or its row was locked by another transaction (deferred, never dropped while the claim holds).
func (p *Pool) settleMissing(items []finishItem) {
	if len(items) == 0 {
		return
	}
	ids, tokens := make([]int64, len(items)), make([]int64, len(items))
	for i, it := range items {
		ids[i], tokens[i] = it.out.ID, it.out.Token
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	held, err := store.StillHeld(ctx, controlDB{p}, ids, tokens)
	cancel()
	for _, it := range items {
		switch {
		case err != nil || held[it.out.ID]:
			p.deferOutcome(it)
		default:
			p.settle(it, "", false)
		}
	}
}

func (p *Pool) deferOutcome(it finishItem) {
	p.deferredMu.Lock()
	p.deferred = append(p.deferred, it)
	p.deferredMu.Unlock()
	p.poke(p.outcomeWake) // the finisher arms its retry (the claim loop defers outcomes too)
}

func (p *Pool) takeDeferred() []finishItem {
	p.deferredMu.Lock()
	defer p.deferredMu.Unlock()
	items := p.deferred
	p.deferred = nil
	return items
}

func (p *Pool) deferredCount() int {
	p.deferredMu.Lock()
	defer p.deferredMu.Unlock()
	return len(p.deferred)
}

// giveUp stops trying to write an outcome: its lease is no longer renewed, and a rescuer takes
// the job back once it expires.
func (p *Pool) giveUp(it finishItem, why string) {
	p.log.Error("giving up writing a job outcome; a rescuer takes the job back when its lease expires",
		slog.Int64("job_id", it.job.claim.ID), slog.Int64("lease_token", it.job.claim.Token), slog.String("outcome", it.out.State),
		slog.String("why", why))
	p.observe(it.job, "", it.dur, false)
	p.forget(it.job)
}

// write stores items' outcomes, recording what was written. A connection failure is retried a
// few times within a second (a fenced write is safe to repeat); what is still not written is
// then settled by the caller (deferred while the database cannot tell). When the database
// rejects the statement itself, one item's content is at fault: the batch is split in halves
// until the bad outcome is alone, so that one bad outcome never holds back or drops the others;
// that one is then written without its details.
func (p *Pool) write(items []finishItem, written map[int64]string, sc *finishScratch) {
	backoff := 20 * time.Millisecond
	deadline := time.Now().Add(time.Second)
	for {
		outs := sc.outcomes(len(items))
		for i := range items {
			outs[i] = items[i].out
		}
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ws, err := store.Finish(sctx, controlDB{p}, outs)
		cancel()
		// Written, even beside an error (halves written before it): a retry of them finds
		// their leases gone and writes nothing.
		for _, w := range ws {
			written[w.ID] = w.State
		}
		p.wakeForFreed(ws)
		if err == nil {
			return
		}
		if rejected(err) {
			if len(items) > 1 {
				mid := len(items) / 2
				p.write(items[:mid], written, sc)
				p.write(items[mid:], written, sc)
				return
			}
			it := items[0]
			p.log.Error("database rejected a job outcome; writing it without its details",
				slog.Int64("job_id", it.job.claim.ID), slog.String("outcome", it.out.State), slog.Any("err", err))
			if bare, ok := withoutDetails(it, err); ok {
				p.write([]finishItem{bare}, written, sc)
			}
			return
		}
		if time.Now().After(deadline) {
			p.log.Warn("writing job outcomes failed; trying again later", slog.Any("err", err), slog.Int("jobs", len(items)))
			return
		}
		time.Sleep(backoff)
		backoff = min(backoff*2, 200*time.Millisecond)
	}
}

// wakeForFreed wakes the claim loop when a written outcome finished a job of a workflow: the
// same commit may have made jobs waiting for it claimable, and claiming now saves a link of a
// chain the round trip of a notification (or the wait for a poll when none was sent, the loop
// not being registered as waiting). A claim that finds nothing costs one empty claim.
func (p *Pool) wakeForFreed(ws []store.Written) {
	for i := range ws {
		if ws[i].Frees {
			p.poke(p.wake)
			return
		}
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
	if it.out.Output != nil {
		it.out.Output, changed = nil, true
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
	// After CompleteTx, an outcome that finds the row no longer held is the expected case: the
	// handler's transaction completed it.
	stale := !written && !j.doneInTx.Load()
	if !written && j.doneInTx.Load() {
		state = store.StateCompleted
		written = true
	}
	if stale {
		p.metrics.StaleWrites.Add(1)
		p.log.Warn("job outcome rejected: lease no longer held under this token; result dropped",
			slog.Int64("job_id", j.claim.ID), slog.Int64("lease_token", j.claim.Token), slog.String("outcome", it.out.State),
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
