package pool

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/internal/listener"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
)

// onRevoked handles a job_revoked notification on the listener's goroutine: it must not block,
// so database work goes to the revocation recorder.
func (p *Pool) onRevoked(r listener.Revocation) {
	j := p.lookupJob(r.ID, r.Token)
	if j == nil || errors.Is(j.lease.Cause(), lease.ErrLost) {
		return // not ours, an earlier claim, or a claim another worker has taken over
	}
	l := j.lease
	if p.cfg.RevokeRequireRow || r.Takeover {
		// Trust only the row: one renewal statement re-checks every lease and ends revoked or
		// lost ones with the right cause. A takeover is always checked so, since anyone who can
		// connect can send one: a forged takeover costs an early renewal (at most one per
		// RenewRetryInterval, however many arrive), not a duplicate run.
		p.keeper.Kick(false)
		return
	}
	reason := clean.Text(r.Reason, store.MaxReasonBytes)
	if reason == "" {
		reason = defaultRevokeReason
	}
	// Durable first, whatever the lease's state: a handler that is already stopping (timed out,
	// shut down, its outcome waiting to be written) must not outlive the revocation and put the
	// job back in the queue.
	rv := store.Revocation{ID: r.ID, Token: l.Token, Attempt: int32(int(j.claim.Attempt)), Reason: reason, Job: r.Token == 0}
	end := func() {
		if !l.End(&revocation{reason: reason}) {
			return
		}
		p.metrics.RevokedByNotification.Add(1)
		p.log.Info("job revoked by notification; cancelling", slog.Int64("job_id", r.ID), slog.Int64("lease_token", l.Token),
			slog.String("reason", reason))
	}
	if !j.fenced.Load() {
		p.revocations.add(rv, nil)
		end()
		return
	}
	// The handler has staged fenced writes: its transaction's commit checks revoked_at in the
	// row, so the handler is cancelled once the row says so (a write of a millisecond or so),
	// never before: cancelled first, it could commit in the gap. Should the write not land
	// within fencedRevokeWait (the database unreachable), the handler is cancelled all the same.
	p.revocations.add(rv, end)
	time.AfterFunc(fencedRevokeWait, end)
}

// fencedRevokeWait bounds how long the cancellation of a handler with fenced writes waits for
// its revocation to be written into the row.
const fencedRevokeWait = time.Second

// recorder writes revocations that arrived as notifications into their jobs' rows, in batches,
// without ever waiting on a row lock: a job whose row another transaction holds is tried again
// until it is written or no longer revocable. It never drops one while the pool runs.
type recorder struct {
	p    *Pool
	wake chan struct{}

	mu      sync.Mutex
	pending map[int64]store.Revocation // by claim token
	after   map[int64][]func()         // by claim token: run once its revocation is settled
}

func newRecorder(p *Pool) *recorder {
	return &recorder{p: p, wake: make(chan struct{}, 1), pending: map[int64]store.Revocation{}, after: map[int64][]func(){}}
}

// add records rv; then, if not nil, runs once rv is written into the row or found no longer
// revocable there.
func (r *recorder) add(rv store.Revocation, then func()) {
	r.mu.Lock()
	if old, dup := r.pending[rv.Token]; !dup || (rv.Job && !old.Job) {
		r.pending[rv.Token] = rv
	}
	if then != nil {
		r.after[rv.Token] = append(r.after[rv.Token], then)
	}
	r.mu.Unlock()
	r.p.poke(r.wake)
}

// run records until ctx is done, then tries once more with what is pending.
func (r *recorder) run(ctx context.Context) {
	backoff := 20 * time.Millisecond
	for {
		var retry <-chan time.Time
		if r.count() > 0 {
			retry = time.After(backoff)
		}
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			r.flush(fctx)
			cancel()
			if n := r.count(); n > 0 {
				r.p.log.Warn("revocations not recorded at shutdown; their jobs' outcomes record them", slog.Int("jobs", n))
			}
			return
		case <-r.wake:
		case <-retry:
		}
		if r.flush(ctx) {
			backoff = 20 * time.Millisecond
		} else {
			backoff = min(2*backoff, time.Second)
		}
	}
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pending)
}

// flush writes what is pending and reports whether nothing is left.
func (r *recorder) flush(ctx context.Context) bool {
	r.mu.Lock()
	rs := make([]store.Revocation, 0, len(r.pending))
	for _, rv := range r.pending {
		rs = append(rs, rv)
	}
	r.mu.Unlock()
	if len(rs) == 0 {
		return true
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	locked, err := store.MarkRevoked(sctx, controlDB{r.p}, rs)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			r.p.log.Warn("recording revocations failed; trying again", slog.Any("err", err), slog.Int("jobs", len(rs)))
		}
		return false
	}
	still := make(map[int64]bool, len(locked))
	for _, id := range locked {
		still[id] = true
	}
	var then []func()
	r.mu.Lock()
	for _, rv := range rs {
		if !still[rv.ID] {
			delete(r.pending, rv.Token)
			then = append(then, r.after[rv.Token]...)
			delete(r.after, rv.Token)
		}
	}
	r.mu.Unlock()
	for _, f := range then {
		f()
	}
	return len(locked) == 0
}
