package pool

import (
	"testing"
	"time"

	"github.com/leashq/leash/internal/store"
)

// However slow a claim from the front gets, one starts at least once per poll interval: no
// runnable job waits behind the cursor longer than a poll.
func TestClaimFromFrontAtLeastEveryPoll(t *testing.T) {
	poll := time.Second
	for cost, want := range map[time.Duration]time.Duration{
		0:                      10 * time.Millisecond, // at least every 10ms
		time.Millisecond:       20 * time.Millisecond, // 5% of the loop's time
		40 * time.Millisecond:  800 * time.Millisecond,
		100 * time.Millisecond: poll, // would be 2s: the poll bounds it
		2 * time.Second:        poll,
	} {
		sc := &claimScan{fullCost: cost}
		if got := sc.fullEvery(poll); got != want {
			t.Errorf("cost %s: from the front every %s; want %s", cost, got, want)
		}
	}
}

// A claim past the cursor looks again at its run_at from where the claims stood cursorLag ago,
// or at all of it when the cursor came to that run_at within the lag.
func TestRecheckFromWhereClaimsStoodALagAgo(t *testing.T) {
	t0 := time.Now()
	runAt := t0.Add(-time.Minute)
	sc := &claimScan{}
	at := func(ms int, id int64, runAt time.Time) {
		sc.after = &store.ClaimCursor{RunAt: runAt, ID: id}
		sc.moved(t0.Add(time.Duration(ms) * time.Millisecond))
	}
	check := func(ms int, want int64) {
		t.Helper()
		if got := sc.recheckFrom(t0.Add(time.Duration(ms) * time.Millisecond)); got != want {
			t.Fatalf("at +%dms: recheck from %d; want %d", ms, got, want)
		}
	}
	at(0, 100, runAt)
	check(50, 0) // no position a lag old yet: all of the run_at
	at(60, 200, runAt)
	at(120, 300, runAt)
	check(130, 100)
	at(200, 400, runAt)
	check(200, 200) // the newest position at least 100ms old
	at(400, 500, runAt.Add(time.Second))
	check(410, 0) // the cursor came to this run_at within the lag
	at(520, 600, runAt.Add(time.Second))
	check(520, 500)
	if n := len(sc.passed); n != 2 {
		t.Fatalf("%d positions kept; want 2 (the newest a lag old, and the last)", n)
	}
}
