package pool

import (
	"crypto/rand"
	"encoding/hex"
	"slices"
	"sync"
	"time"
)

// A waiting pool is woken on a channel of its own (wakeChannel), with the name of the queue an
// insert picked it for (see sql/016_targeted_wakes.sql), as well as by job_available, which every
// listener hears. Both are hints: wakeGate keeps notifications that lead to nothing (forged ones,
// duplicates, another worker's job) from making the claim loop spin.

// newWakeChannel returns a fresh channel name for a pool's wakes: "leash_wake_" and 16 hex
// digits, as leash.waiters' check requires.
func newWakeChannel() string {
	var b [8]byte
	rand.Read(b[:])
	return "leash_wake_" + hex.EncodeToString(b[:])
}

// onWake handles a notification on the pool's wake channel: payload names the queue an insert
// picked the pool for. A payload naming none of the pool's queues is counted and ignored.
func (p *Pool) onWake(payload string) {
	if !slices.Contains(p.cfg.Queues, payload) {
		p.metrics.Notify.WakesIgnored.Add(1)
		return
	}
	p.metrics.Notify.Wakes.Add(1)
	p.picked.Store(true)
	p.wakeUp()
}

// onAvailable handles a job_available notification.
func (p *Pool) onAvailable(queue string) {
	if slices.Contains(p.cfg.Queues, queue) {
		p.wakeUp()
	}
}

// wakeUp wakes the claim loop for a notification, unless claims after recent notifications kept
// finding nothing: then the wake is held back until the gate opens (never dropped).
func (p *Pool) wakeUp() {
	if d := p.gate.pass(time.Now()); d > 0 {
		p.metrics.Notify.WakesHeld.Add(1)
		p.gate.later(d, func() { p.poke(p.wake) })
		return
	}
	p.poke(p.wake)
}

// wakeGate rate-limits what notifications make the claim loop do while they lead to nothing: the
// first wakeFree notifications after a claim that found work pass at once, each one after that
// waits twice as long as the one before (from 1ms up to max). A claim that finds work opens it.
type wakeGate struct {
	mu      sync.Mutex
	strikes int       // notifications passed since a claim last found work
	next    time.Time // none passes before
	held    bool      // a held-back wake is scheduled
	max     time.Duration
}

// wakeFree is how many notifications pass at once after a claim that found work.
const wakeFree = 4

// wakeHoldMax is the longest a notification is held back (at most the poll interval).
const wakeHoldMax = 100 * time.Millisecond

// pass reports 0 when a notification at now may wake the claim loop, else how long to hold it.
func (g *wakeGate) pass(now time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if now.Before(g.next) {
		return g.next.Sub(now)
	}
	g.strikes++
	if g.strikes > wakeFree {
		g.next = now.Add(min(time.Millisecond<<min(g.strikes-wakeFree-1, 20), g.max))
	}
	return 0
}

// later runs f after d, unless a held-back wake is already scheduled.
func (g *wakeGate) later(d time.Duration, f func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held {
		return
	}
	g.held = true
	time.AfterFunc(d, func() {
		g.mu.Lock()
		g.held = false
		g.mu.Unlock()
		f()
	})
}

// found records that a claim found work: notifications pass at once again.
func (g *wakeGate) found() {
	g.mu.Lock()
	g.strikes, g.next = 0, time.Time{}
	g.mu.Unlock()
}
