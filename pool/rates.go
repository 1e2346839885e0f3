package pool

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/leashq/leash/internal/store"
)

// SetQueueRateLimit limits the queue to n job starts in any window of period across all
// workers, through leash.set_queue_rate_limit; a negative n removes the limit, 0 starts nothing.
// A start is a claim of a job (a first attempt, a retry, a job snoozed or handed back running
// again), counted at its attempted_at on the database clock; the limit is exact (every claim of
// the queue writes its starts into a ring of n slots under the queue's row, see
// sql/025_concurrency_keys.sql). It binds every worker of this release from its commit (it waits
// for the claims of the queue in flight): a window after the change holds at most the new n.
// Workers of releases before it ignore the limit. period is rounded up to the millisecond,
// between 1 ms and 31 days; n at most 1,000,000.
func SetQueueRateLimit(ctx context.Context, db DB, name string, n int, period time.Duration) error {
	if err := checkQueueName(name); err != nil {
		return err
	}
	var limit *int
	if n >= 0 {
		if n > MaxRateLimit || period < time.Millisecond || period > 31*24*time.Hour {
			return fmt.Errorf("pool: rate limit must be 0 to %d starts per 1ms to 31 days, got %d per %s", MaxRateLimit, n, period)
		}
		limit = &n
	}
	_, err := store.SetQueueRateLimit(ctx, db, name, limit, period)
	return err
}

// MaxRateLimit bounds SetQueueRateLimit's n, as the table's check does.
const MaxRateLimit = 1_000_000

// SetQueueKeyRateLimit limits the starts of the jobs of each concurrency key
// (InsertOpts.ConcurrencyKey) of the queue to n in any window of period across all workers,
// through leash.set_queue_key_rate_limit; a negative n removes the limit, 0 starts no job with a
// key. Starts are counted as SetQueueRateLimit counts them, per key, and the limit is as exact
// (every claim of the queue writes the starts of each key it started, see
// sql/029_key_rate_limits.sql); it combines with the queue's other limits (a per-key limit, a
// rate limit, MaxRunning): a job starts only when each has room. Jobs without a key are not
// limited by it. A key with no room costs the claims nothing: they pass over it until its oldest
// counted start leaves the window, and the worker that claimed last wakes then to claim it. It
// binds every worker of this release from its commit; workers of releases before it ignore the
// limit. period is rounded up to the millisecond, between 1 ms and 31 days; n at most 1,000.
func SetQueueKeyRateLimit(ctx context.Context, db DB, name string, n int, period time.Duration) error {
	if err := checkQueueName(name); err != nil {
		return err
	}
	var limit *int
	if n >= 0 {
		if n > MaxKeyRateLimit || period < time.Millisecond || period > 31*24*time.Hour {
			return fmt.Errorf("pool: per-key rate limit must be 0 to %d starts per 1ms to 31 days, got %d per %s", MaxKeyRateLimit, n, period)
		}
		limit = &n
	}
	_, err := store.SetQueueKeyRateLimit(ctx, db, name, limit, period)
	return err
}

// MaxKeyRateLimit bounds SetQueueKeyRateLimit's n, as the table's check does: a key's starts are
// kept in one row, rewritten at each claim that starts the key.
const MaxKeyRateLimit = 1_000

// rateHolds keeps, per rate-limited queue, until when its last claim found the limit reached:
// the pool does not claim the queue before then (the database remains the authority: a claim
// then may still find no room, another worker having taken it), and a timer wakes the claim
// loop at the earliest such time. A pool claims a rate-limited queue in one claim at a time
// (claiming): its other claims in flight pass over it rather than find its row held, so the
// pool's other queues keep all their claims in flight.
type rateHolds struct {
	mu       sync.Mutex
	until    map[string]time.Time
	nudges   map[string]time.Time // when to wake the loop for a queue, without holding it back
	claiming map[string]bool
	timer    *time.Timer
	at       time.Time // when timer fires; zero when none is set
}

// begin reports whether a claim may take queue now (not held, no other claim of the pool on
// it); when true, the caller calls end once its claim returned.
func (r *rateHolds) begin(queue string, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Before(r.until[queue]) || r.claiming[queue] {
		return false
	}
	if r.claiming == nil {
		r.claiming = make(map[string]bool)
	}
	r.claiming[queue] = true
	return true
}

// end records that the claim of queue begun returned.
func (r *rateHolds) end(queue string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.claiming, queue)
}

// hold keeps queue from claims for d (if d > 0) and makes sure wake runs when it ends.
func (r *rateHolds) hold(queue string, d time.Duration, wake func()) {
	if d <= 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.until == nil {
		r.until = make(map[string]time.Time)
	}
	end := time.Now().Add(d)
	r.until[queue] = end
	r.arm(end, d, wake)
}

// nudge makes sure wake runs once d (if d > 0) has passed, without keeping queue from claims
// meanwhile; a later nudge of the same queue replaces it.
func (r *rateHolds) nudge(queue string, d time.Duration, wake func()) {
	if d <= 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.nudges == nil {
		r.nudges = make(map[string]time.Time)
	}
	end := time.Now().Add(d)
	r.nudges[queue] = end
	r.arm(end, d, wake)
}

// arm sets the timer to fire at end (d from now) unless it fires before. r.mu is held.
func (r *rateHolds) arm(end time.Time, d time.Duration, wake func()) {
	if !r.at.IsZero() && !end.Before(r.at) {
		return // the timer set fires first, and sets the next
	}
	if r.timer != nil {
		r.timer.Stop()
	}
	r.at = end
	r.timer = time.AfterFunc(d, func() { r.fired(wake) })
}

// fired ends the timer: it sets the next for the earliest hold still ahead, and wakes the loop.
func (r *rateHolds) fired(wake func()) {
	r.mu.Lock()
	r.at = time.Time{}
	next := time.Time{}
	now := time.Now()
	for _, u := range r.until {
		if u.After(now) && (next.IsZero() || u.Before(next)) {
			next = u
		}
	}
	for q, u := range r.nudges {
		switch {
		case !u.After(now):
			delete(r.nudges, q)
		case next.IsZero() || u.Before(next):
			next = u
		}
	}
	if !next.IsZero() {
		r.at = next
		r.timer = time.AfterFunc(time.Until(next), func() { r.fired(wake) })
	}
	r.mu.Unlock()
	wake()
}

// clear forgets every hold (the queues' limits may have changed).
func (r *rateHolds) clear() {
	r.mu.Lock()
	defer r.mu.Unlock()
	clear(r.until)
}
