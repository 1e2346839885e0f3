package pool

import (
	"errors"
	"testing"
	"time"
)

// The claim loop's transitions, one at a time: what each claim result leaves behind, the
// gathering of free slots, and when an idle loop claims again.
func TestClaimStateTransitions(t *testing.T) {
	t.Parallel()
	s := claimState{claimNow: true}
	if !s.returned(claimResult{limit: 4, n: 4}) || !s.saturated || !s.claimNow || !s.idleSince.IsZero() {
		t.Fatalf("after a full claim: %+v", s)
	}
	// Jobs are waiting: with fewer slots free than a claim's share, let them free up first.
	if !s.gather(1, 4, time.Hour) || s.gatherUntil.IsZero() {
		t.Fatalf("not gathering: %+v", s)
	}
	if s.gather(4, 4, time.Hour) || !s.gatherUntil.IsZero() {
		t.Fatalf("gathering with every slot free: %+v", s)
	}
	// A notification while a claim runs makes the next empty claim claim again at once.
	s.notified()
	if s.returned(claimResult{limit: 4}) || !s.claimNow || s.woken || s.idleSince.IsZero() || s.saturated {
		t.Fatalf("after an empty claim that was notified: %+v", s)
	}
	if s.returned(claimResult{limit: 4}) || s.claimNow {
		t.Fatalf("after an empty claim: %+v", s)
	}
	if !s.waited(0) || s.waited(time.Hour) {
		t.Fatalf("waited: %+v", s)
	}
	p := &Pool{cfg: Config{PollInterval: time.Second, Engine: EngineConfig{IdlePollInterval: 3 * time.Millisecond}}}
	w := &waiting{p: p}
	if d := s.recheck(p, w, false, false, false); d != 3*time.Millisecond {
		t.Fatalf("idle, not registered: recheck %s", d)
	}
	w.registered = true
	for i := range registeredRechecks {
		if d := s.recheck(p, w, false, true, false); d != time.Millisecond<<i {
			t.Fatalf("recheck %d after registering: %s", i, d)
		}
	}
	if d := s.recheck(p, w, false, true, false); d != 0 {
		t.Fatalf("registered, rechecks done: %s", d)
	}
	// A capped queue's row held: back off, doubling, without counting as idle.
	s = claimState{}
	s.returned(claimResult{limit: 4, busy: true})
	s.returned(claimResult{limit: 4, busy: true})
	if d := s.recheck(p, &waiting{p: p}, false, false, false); d != 6*time.Millisecond || !s.idleSince.IsZero() {
		t.Fatalf("busy twice: recheck %s, %+v", d, s)
	}
	// A failed claim waits for a wake-up or the poll.
	s.returned(claimResult{err: errors.New("down")})
	if !s.failed || s.claimNow || s.parallel(p) != 1 || s.recheck(p, w, false, false, false) != 0 {
		t.Fatalf("after a failed claim: %+v", s)
	}
}
