package pool

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
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

// While claims from the front are slow they run beside the claims past the cursor. One that
// takes all it asked for takes the cursor back, so that a backlog behind the cursor (here jobs
// with a run_at an hour old) drains at the pace of the claims, not one such claim per poll.
// The concurrency bound holds throughout.
func TestClaimFromFrontBesideTakesCursorBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	const concurrency, backlog = 20, 200
	poll := 400 * time.Millisecond
	p, err := New(db, Config{Concurrency: concurrency, PollInterval: poll})
	if err != nil {
		t.Fatal(err)
	}
	// Every claim from the front runs beside the others, at most once per poll.
	p.scan.besideCost, p.scan.everyFloor = time.Nanosecond, poll
	var running, most atomic.Int64
	started := make(chan time.Time, backlog+10)
	if err := p.Register("k", HandlerFunc(func(context.Context, *Job) error {
		n := running.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		time.Sleep(time.Millisecond)
		running.Add(-1)
		started <- time.Now()
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); p.Run(rctx) }()
	defer func() { cancel(); <-done }()
	// A few jobs set the cursor.
	for range 5 {
		if _, err := Insert(ctx, db, "k", nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	for range 5 {
		<-started
	}
	if _, err := db.Exec(ctx, `
		INSERT INTO leash.jobs (kind, run_at) SELECT 'k', now() - interval '1 hour' FROM generate_series(1, $1)`, backlog); err != nil {
		t.Fatal(err)
	}
	inserted := time.Now()
	timeout := time.After(30 * time.Second)
	var last time.Time
	for range backlog {
		select {
		case last = <-started:
		case <-timeout:
			t.Fatal("the backlog behind the cursor did not drain")
		}
	}
	// A claim beside takes at most half the slots, once per poll: 20 polls for the backlog
	// without the cursor taken back. With it, about one poll and the claims' pace.
	if took := last.Sub(inserted); took > 5*poll {
		t.Fatalf("the backlog behind the cursor took %s to start, want at most %s", took, 5*poll)
	}
	if m := most.Load(); m > concurrency {
		t.Fatalf("%d handlers at once, more than Concurrency %d", m, concurrency)
	}
	p.scan.mu.Lock()
	gen := p.scan.gen
	p.scan.mu.Unlock()
	if gen == 0 {
		t.Fatal("no claim from the front took the cursor back")
	}
}

// An idle worker claims only when polled or woken (by an insert into its queue, served by a claim
// past the cursor). With claims from the front slow, so that fullEvery is the poll interval
// itself, each job committed behind the cursor is found by a claim from the front that begins
// within one poll interval as configured of its commit, whatever the poll's jitter: the gap
// between two such claims never exceeds PollInterval. On a fake clock, with the claim loop's
// decisions (frontDue, frontBegins, polled) and its jitter.
func TestJobBehindCursorWaitsAtMostOnePoll(t *testing.T) {
	const poll = time.Second
	sc := &claimScan{after: &store.ClaimCursor{}, fullCost: time.Second}
	if sc.fullEvery(poll) != poll {
		t.Fatalf("fullEvery %s, want the poll interval", sc.fullEvery(poll))
	}
	now := time.Unix(1e9, 0)
	sc.lastFull = now
	last := now // the last claim from the front began
	worst := time.Duration(0)
	claim := func() { // what claimUncapped and besideDue decide at now
		if !sc.frontDue(now, poll) {
			return // past the cursor
		}
		sc.frontBegins()
		sc.lastFull = now // the claim succeeded: began is when it was decided
		worst, last = max(worst, now.Sub(last)), now
	}
	for i := range 20000 {
		gap := jitteredPoll(poll)
		if gap > poll || gap < poll-poll/5 {
			t.Fatalf("a poll after %s: want between 80%% and 100%% of %s", gap, poll)
		}
		if i%3 == 0 { // an insert wakes the worker between two polls
			now = now.Add(gap / 3)
			claim()
			now = now.Add(gap - gap/3)
		} else {
			now = now.Add(gap)
		}
		sc.polled()
		claim()
	}
	if worst > poll {
		t.Fatalf("a job behind the cursor could wait %s for a claim from the front, more than the poll interval %s", worst, poll)
	}
}

// End to end, on an idle worker whose claims from the front are due only once per poll interval
// (as when they are slow): jobs of a higher priority than the cursor's, inserted one at a time,
// each start within one poll interval plus a generous margin.
func TestHigherPriorityBehindCursorWithinOnePoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	// Long enough that half of it covers a loaded machine's claim and start; without the claims
	// from the front such a job never starts.
	const poll = 2 * time.Second
	p, err := New(db, Config{Concurrency: 4, PollInterval: poll, Engine: EngineConfig{WaitAfter: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	p.scan.everyFloor = poll // fullEvery is the poll interval
	started := make(chan int64, 100)
	if err := p.Register("k", HandlerFunc(func(_ context.Context, j *Job) error {
		started <- j.ID
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); p.Run(rctx) }()
	defer func() { cancel(); <-done }()
	for range 5 { // they set the cursor
		if _, err := Insert(ctx, db, "k", nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	for range 5 {
		<-started
	}
	worst := time.Duration(0)
	for i := range 6 {
		// Each ahead of the last: from the front, the cursor goes to the job found.
		id, err := Insert(ctx, db, "k", nil, &InsertOpts{Priority: int16(-1 - i)})
		if err != nil {
			t.Fatal(err)
		}
		inserted := time.Now()
		select {
		case got := <-started:
			if got != id {
				t.Fatalf("job %d started, want %d", got, id)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("a job behind the cursor never started")
		}
		worst = max(worst, time.Since(inserted))
	}
	t.Logf("worst wait %s", worst)
	if worst > poll+poll/2 {
		t.Fatalf("a job behind the cursor waited %s, want at most about one poll interval (%s)", worst, poll)
	}
}
