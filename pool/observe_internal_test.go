package pool

import (
	"io"
	"log/slog"
	"testing"
	"time"
)

// gatedObserver records the kinds it is told of, in order; the first JobFinished blocks until
// release is closed, and kind "boom" panics.
type gatedObserver struct {
	entered, release chan struct{}
	seen             []string
}

func (o *gatedObserver) JobStarted(ev JobEvent) { o.seen = append(o.seen, "start:"+ev.Kind) }

func (o *gatedObserver) JobFinished(ev JobEvent) {
	if o.entered != nil {
		close(o.entered)
		o.entered = nil
		<-o.release
	}
	if ev.Kind == "boom" {
		panic("observer broken")
	}
	o.seen = append(o.seen, "finish:"+ev.Kind)
}

// The queue holds at most maxQueuedEvents events besides the one being delivered, however the
// events arrive; past that they are dropped and counted. Delivery keeps the order, survives a
// panicking Observer, and ends once close has delivered everything.
func TestEventQueueBoundOrderAndPanic(t *testing.T) {
	t.Parallel()
	entered := make(chan struct{})
	obs := &gatedObserver{entered: entered, release: make(chan struct{})}
	e := newEventQueue(obs, slog.New(slog.NewTextHandler(io.Discard, nil)))
	e.emit(false, JobEvent{Kind: "first"})
	for range maxQueuedEvents - 1 {
		e.emit(false, JobEvent{Kind: "queued"})
	}
	go e.run()
	<-entered // the first is being delivered; the rest are queued
	const burst = 100_000
	for range burst {
		e.emit(false, JobEvent{Kind: "burst"})
	}
	if got, want := e.droppedCount(), int64(burst-1); got != want {
		t.Fatalf("dropped %d of a burst of %d behind a full queue, want %d", got, burst, want)
	}
	close(obs.release)
	if ok, _ := e.close(10*time.Second, nil, 0); !ok {
		t.Fatal("close did not deliver the queued events")
	}
	if n := len(obs.seen); n != maxQueuedEvents+1 {
		t.Fatalf("delivered %d events, want %d", n, maxQueuedEvents+1)
	}

	obs = &gatedObserver{}
	e = newEventQueue(obs, slog.New(slog.NewTextHandler(io.Discard, nil)))
	go e.run()
	for _, k := range []string{"a", "boom", "b"} {
		e.emit(true, JobEvent{Kind: k})
		e.emit(false, JobEvent{Kind: k})
	}
	if ok, _ := e.close(10*time.Second, nil, 0); !ok {
		t.Fatal("close did not deliver the queued events")
	}
	want := []string{"start:a", "finish:a", "start:boom", "start:b", "finish:b"}
	if len(obs.seen) != len(want) {
		t.Fatalf("delivered %v, want %v", obs.seen, want)
	}
	for i := range want {
		if obs.seen[i] != want[i] {
			t.Fatalf("delivered %v, want %v", obs.seen, want)
		}
	}
}

// Events keep their order when the queue moves those not yet delivered to the front of its
// array instead of growing it, and the array is used again once everything was delivered.
func TestEventQueueKeepsOrderWhenItReusesItsArray(t *testing.T) {
	t.Parallel()
	entered := make(chan struct{})
	obs := &gatedObserver{entered: entered, release: make(chan struct{})}
	e := newEventQueue(obs, slog.New(slog.NewTextHandler(io.Discard, nil)))
	e.emit(false, JobEvent{Kind: "first"})
	e.emit(false, JobEvent{Kind: "a"}) // an array of two, full
	go e.run()
	<-entered // the first is being delivered: the next event moves "a" to the array's front
	for _, k := range []string{"b", "c"} {
		e.emit(false, JobEvent{Kind: k})
	}
	close(obs.release)
	if ok, _ := e.close(10*time.Second, nil, 0); !ok {
		t.Fatal("close did not deliver the queued events")
	}
	want := []string{"finish:first", "finish:a", "finish:b", "finish:c"}
	if len(obs.seen) != len(want) {
		t.Fatalf("delivered %v, want %v", obs.seen, want)
	}
	for i := range want {
		if obs.seen[i] != want[i] {
			t.Fatalf("delivered %v, want %v", obs.seen, want)
		}
	}
}
