// Package leasekeeper is the lease machinery behind package lease: a Lease per claimed job
// holding its fencing token and a trust deadline on the monotonic clock, a Keeper that renews all
// of a worker's leases in one statement per heartbeat, and a Rescuer that takes back jobs whose
// lease expired. A lease ends with one of package lease's causes, which cancel the job's context.
// Only package pool uses it: handler code cannot end, mark or renew a lease.
package leasekeeper

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leashq/leash/lease"
)

// The causes of package lease, under short names for the machinery.
var (
	ErrRevoked        = lease.ErrRevoked
	ErrLost           = lease.ErrLost
	ErrRenewalTimeout = lease.ErrRenewalTimeout
	ErrShutdown       = lease.ErrShutdown
)

// RevokedError is the cause of a revocation found in the job's row (by a renewal, or the re-check
// after the listener reconnected): it matches ErrRevoked and carries the row's revoke_reason, so
// the handler and the job's errors history say why, as they do for a notified revocation.
type RevokedError struct {
	Reason string
}

func (e *RevokedError) Error() string        { return "job revoked: " + e.Reason }
func (e *RevokedError) Is(target error) bool { return target == ErrRevoked }

// Lease is one claim of one job: its id, its fencing token and how long this worker may trust
// that it still holds it.
type Lease struct {
	// JobID is the leased job.
	JobID int64
	// Token is the fencing token of this claim; every write about the job carries it.
	Token int64

	cancel    context.CancelCauseFunc
	timer     *time.Timer
	window    time.Duration // lease duration minus safety margin
	onEnd     func(*Lease, error)
	finishing atomic.Bool

	mu           sync.Mutex
	trustedUntil time.Time
	cause        error
	released     bool // settled and no longer supervised: no renewal revives its timer
}

// EnsureActive returns nil while the lease is safe for writes, and its cause once it is not.
// Passing the trust deadline ends the lease with ErrRenewalTimeout, even if the timer that
// enforces it has not fired yet.
func (l *Lease) EnsureActive() error {
	l.mu.Lock()
	cause := l.cause
	expired := cause == nil && !time.Now().Before(l.trustedUntil)
	l.mu.Unlock()
	if expired {
		l.End(ErrRenewalTimeout)
		return l.Cause()
	}
	return cause
}

// Cause is the reason the lease ended, or nil while it holds.
func (l *Lease) Cause() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cause
}

// trustDeadline is the monotonic deadline until which the lease is trusted.
func (l *Lease) trustDeadline() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.trustedUntil
}

// End ends the lease with cause and cancels the job's context with it. Only the first cause
// counts; End reports whether this call was it.
func (l *Lease) End(cause error) bool {
	l.mu.Lock()
	if l.cause != nil {
		l.mu.Unlock()
		return false
	}
	l.cause = cause
	l.mu.Unlock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.cancel(cause)
	if l.onEnd != nil {
		l.onEnd(l, cause)
	}
	return true
}

// MarkFinishing marks that the attempt is being settled (its handler returned and its outcome
// is being written, or the worker gave up on it): a renewal that no longer finds the lease is
// then expected, not a loss. It reports whether this call marked it, so that exactly one party
// settles an attempt.
func (l *Lease) MarkFinishing() bool { return l.finishing.CompareAndSwap(false, true) }

// Finishing reports whether MarkFinishing was called.
func (l *Lease) Finishing() bool { return l.finishing.Load() }

// expire runs when the trust timer fires: it ends the lease unless a renewal moved the deadline
// on in the meantime.
func (l *Lease) expire() {
	l.mu.Lock()
	until, released := l.trustedUntil, l.released
	l.mu.Unlock()
	if released {
		return
	}
	if d := time.Until(until); d > 0 {
		l.timer.Reset(d)
		return
	}
	l.End(ErrRenewalTimeout)
}

// confirm records a renewal confirmed by the database for a statement sent at sentAt.
func (l *Lease) confirm(sentAt time.Time) {
	until := sentAt.Add(l.window)
	l.mu.Lock()
	if l.cause != nil || l.released || !until.After(l.trustedUntil) {
		l.mu.Unlock()
		return
	}
	l.trustedUntil = until
	l.mu.Unlock()
	if d := time.Until(until); d > 0 {
		l.timer.Reset(d)
	} else {
		l.End(ErrRenewalTimeout)
	}
}
