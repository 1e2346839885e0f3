package pool

import (
	"testing"
	"time"
)

// A held queue is passed over until its hold ends, and the loop is woken then: for each hold,
// earliest first, also when a later hold was set before an earlier one. One claim of the pool
// at a time takes a queue.
func TestRateHolds(t *testing.T) {
	t.Parallel()
	var r rateHolds
	woken := make(chan time.Time, 10)
	wake := func() { woken <- time.Now() }
	began := time.Now()
	r.hold("slow", 80*time.Millisecond, wake)
	r.hold("fast", 20*time.Millisecond, wake)
	if r.begin("fast", time.Now()) || r.begin("slow", time.Now()) {
		t.Fatal("a held queue may be claimed")
	}
	first := <-woken
	if !r.begin("fast", time.Now()) {
		t.Fatal("fast is still held once woken")
	}
	if r.begin("fast", time.Now()) {
		t.Fatal("two claims of the pool took fast at once")
	}
	r.end("fast")
	second := <-woken
	if d := first.Sub(began); d < 20*time.Millisecond || d >= 80*time.Millisecond {
		t.Fatalf("first wake after %s; want fast's 20ms", d)
	}
	if d := second.Sub(began); d < 80*time.Millisecond {
		t.Fatalf("second wake after %s; want slow's 80ms", d)
	}
	if !r.begin("slow", time.Now()) {
		t.Fatal("slow is still held once woken")
	}
	r.end("slow")
	r.hold("fast", time.Hour, wake)
	r.clear()
	if !r.begin("fast", time.Now()) {
		t.Fatal("a cleared hold still holds")
	}
}
