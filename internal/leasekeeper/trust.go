package leasekeeper

import (
	"sync"
	"time"
)

// trustWatch ends the leases of one claim with ErrRenewalTimeout once their trust windows pass.
// A claim's leases share its send time, and so their first deadline, and renewals confirm them
// together: one timer, set for the earliest deadline among its leases, serves them all, instead
// of a timer per lease. When it fires it ends the leases whose deadline has passed and is set
// again for the earliest of the others (renewals move deadlines on without touching it), so each
// lease ends when its own deadline passes, as with a timer of its own.
type trustWatch struct {
	sentAt time.Time // the send time of the claim whose leases join this watch

	mu     sync.Mutex
	timer  *time.Timer
	at     time.Time // when timer fires
	leases []*Lease  // nil where a lease left (released, ended)
	live   int       // leases not nil
	closed bool      // every lease left and the timer is stopped: no lease joins any more
}

// watchTrust puts l, claimed by a statement sent at sentAt, under a trust watch: the one of the
// last claim if sentAt is its send time, else a new one.
func (k *Keeper) watchTrust(l *Lease, sentAt time.Time) {
	k.watchMu.Lock()
	defer k.watchMu.Unlock()
	if w := k.watch; w != nil && w.sentAt.Equal(sentAt) && w.add(l) {
		return
	}
	w := &trustWatch{sentAt: sentAt}
	w.mu.Lock() // check waits for the timer to be assigned
	w.leases, w.live = append(w.leases, l), 1
	l.watch, l.slot = w, 0
	w.at = l.trustDeadline()
	w.timer = time.AfterFunc(time.Until(w.at), w.check)
	w.mu.Unlock()
	k.watch = w
}

// add puts l under w; false when w is closed.
func (w *trustWatch) add(l *Lease) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	l.watch, l.slot = w, len(w.leases)
	w.leases = append(w.leases, l)
	w.live++
	// The deadline is the claim's, which the timer was first set for; once renewals moved the
	// others' on, the timer may be set for later.
	if until := l.trustDeadline(); until.Before(w.at) {
		w.at = until
		w.timer.Reset(time.Until(until))
	}
	return true
}

// remove takes l from w (once it is released); the timer stops with the last lease.
func (w *trustWatch) remove(l *Lease) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed || w.leases[l.slot] != l {
		return
	}
	w.leaseLeft(l.slot)
}

// leaseLeft empties slot i. Called with w.mu held.
func (w *trustWatch) leaseLeft(i int) {
	w.leases[i] = nil
	if w.live--; w.live == 0 {
		w.closed = true
		w.leases = nil
		w.timer.Stop()
	}
}

// check runs when the timer fires: it ends the leases whose trust has passed, lets go of those
// that ended or were released, and sets the timer for the earliest deadline left.
func (w *trustWatch) check() {
	now := time.Now()
	var due []*Lease
	var next time.Time
	w.mu.Lock()
	for i, l := range w.leases {
		if l == nil {
			continue
		}
		until, over := l.trustState()
		switch {
		case over:
			w.leaseLeft(i)
		case !now.Before(until):
			due = append(due, l)
			w.leaseLeft(i)
		case next.IsZero() || until.Before(next):
			next = until
		}
	}
	if !next.IsZero() {
		w.at = next
		w.timer.Reset(time.Until(next))
	}
	w.mu.Unlock()
	for _, l := range due {
		l.End(ErrRenewalTimeout)
	}
}
