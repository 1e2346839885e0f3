package pool

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// maxQueuedEvents bounds the events waiting for a slow Observer; past it new events are dropped
// (and counted in Stats.EventsDropped) rather than held in memory without end.
const maxQueuedEvents = 1 << 16

// reusedEvents is the largest queue array kept for the next events once every event in it was
// delivered.
const reusedEvents = 4096

// observerEvent is one call owed to the Observer.
type observerEvent struct {
	started bool // JobStarted, else JobFinished
	ev      JobEvent
}

// eventQueue hands JobEvents to Config.Observer on a goroutine of its own, in the order they
// happened, so that an Observer that is slow (or blocks) delays only itself: never the claim
// loop, a handler's start or the finisher that writes outcomes.
type eventQueue struct {
	obs      Observer
	startObs StartObserver
	log      *slog.Logger

	mu        sync.Mutex
	queue     []observerEvent // from head on: the events not yet delivered
	head      int
	closed    bool
	abandoned bool // close gave up waiting: nothing more is delivered
	wake      chan struct{}
	done      chan struct{}
	dropped   atomic.Int64
	warnedAt  atomic.Int64 // unix nanos of the last warning about drops
}

func newEventQueue(obs Observer, log *slog.Logger) *eventQueue {
	e := &eventQueue{obs: obs, log: log, wake: make(chan struct{}, 1), done: make(chan struct{})}
	e.startObs, _ = obs.(StartObserver)
	return e
}

// wantsStarts reports whether JobStarted events are delivered at all.
func (e *eventQueue) wantsStarts() bool { return e != nil && e.startObs != nil }

// droppedCount is how many events were dropped (0 without an Observer).
func (e *eventQueue) droppedCount() int64 {
	if e == nil {
		return 0
	}
	return e.dropped.Load()
}

// emit queues one event; it never blocks.
func (e *eventQueue) emit(started bool, ev JobEvent) {
	if e == nil || (started && e.startObs == nil) {
		return
	}
	e.mu.Lock()
	if e.closed || len(e.queue)-e.head >= maxQueuedEvents {
		closed := e.closed
		e.mu.Unlock()
		if !closed {
			e.drop()
		}
		return
	}
	if len(e.queue) == cap(e.queue) && e.head > 0 {
		// Full: move the events not yet delivered to the front rather than grow the array.
		n := copy(e.queue, e.queue[e.head:])
		clear(e.queue[n:])
		e.queue, e.head = e.queue[:n], 0
	}
	e.queue = append(e.queue, observerEvent{started: started, ev: ev})
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

func (e *eventQueue) drop() {
	e.dropped.Add(1)
	now := time.Now().UnixNano()
	if last := e.warnedAt.Load(); now-last > int64(time.Minute) && e.warnedAt.CompareAndSwap(last, now) {
		e.log.Warn("the Observer is falling behind; job events dropped",
			slog.Int("queued", maxQueuedEvents), slog.Int64("dropped_total", e.dropped.Load()))
	}
}

// run delivers events, one at a time and in order, until close is called and every queued
// event is delivered, or close gives up on the Observer.
func (e *eventQueue) run() {
	defer close(e.done)
	for {
		e.mu.Lock()
		if e.abandoned {
			e.mu.Unlock()
			return
		}
		if e.head == len(e.queue) {
			// Delivered: the array is used again (a small one: a burst's is let go).
			closed := e.closed
			e.queue, e.head = e.queue[:0], 0
			if cap(e.queue) > reusedEvents {
				e.queue = nil
			}
			e.mu.Unlock()
			if closed {
				return
			}
			<-e.wake
			continue
		}
		oe := e.queue[e.head]
		e.queue[e.head] = observerEvent{}
		e.head++
		e.mu.Unlock()
		e.deliver(oe)
	}
}

// deliver makes one call; an Observer's panic is logged, never fatal to the pool.
func (e *eventQueue) deliver(oe observerEvent) {
	defer func() {
		if r := recover(); r != nil {
			e.log.Error("the Observer panicked", slog.String("kind", oe.ev.Kind), slog.String("panic", describe(r)))
		}
	}()
	if oe.started {
		e.startObs.JobStarted(oe.ev)
	} else {
		e.obs.JobFinished(oe.ev)
	}
}

// close stops taking events and waits for the queued ones to be delivered: at most wait, and
// at most after more once stop is closed (nil: never). When it gives up, the events still queued
// are dropped (counted in dropped, never delivered later): it reports whether every event was
// delivered, and how many were dropped.
func (e *eventQueue) close(wait time.Duration, stop <-chan struct{}, after time.Duration) (delivered bool, dropped int) {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-e.done:
		return true, 0
	case <-t.C:
		return false, e.abandon()
	case <-stop:
	}
	t2 := time.NewTimer(after)
	defer t2.Stop()
	select {
	case <-e.done:
		return true, 0
	case <-t.C:
	case <-t2.C:
	}
	return false, e.abandon()
}

// abandon drops the queued events and stops delivery after the call in progress, if any.
func (e *eventQueue) abandon() int {
	e.mu.Lock()
	e.abandoned = true
	n := len(e.queue) - e.head
	e.queue, e.head = nil, 0
	e.mu.Unlock()
	e.dropped.Add(int64(n))
	return n
}
