package pool_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/notify"
	"github.com/leashq/leash/pool"
)

// A trickle on a pool of Concurrency 1: each claim fills the pool, which then works on its own
// and waits again; every job starts promptly although the poll is a minute away.
func TestTrickleOnConcurrencyOne(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 1
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	for range 10 {
		insert(t, db, "noop", nil, nil)
		b.events.wait(t, 1, 15*time.Second) // the poll is a minute away
		waitPickable(t, db, 1)
	}
}

// A job handed back at shutdown is started at once by a pool that waits for wake-ups.
func TestHandBackReachesAWaitingPool(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	started := make(chan struct{}, 1)
	var calls atomic.Int64
	h := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		// A hand-back costs no attempt: the first run is told by the count of runs.
		if calls.Add(1) == 1 {
			started <- struct{}{}
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	b := &bundle{db: db, events: make(events, 1000)}
	ps := map[string]*pool.Pool{}
	for _, id := range []string{"h0", "h1"} {
		c := cfg
		c.ID, c.Observer = id, b.events
		ps[id], _ = setup(t, db, c, map[string]pool.Handler{"block": h})
		start(t, ps[id])
	}
	waitPickable(t, db, 2)
	settle(t, []*pool.Pool{ps["h0"], ps["h1"]})
	id := insert(t, db, "block", nil, nil)
	<-started
	var by string
	if err := db.QueryRow(context.Background(), `SELECT leased_by FROM leash.jobs WHERE id = $1`, id).Scan(&by); err != nil {
		t.Fatal(err)
	}
	holder := ps[by]
	// The grace period is the first Shutdown's context.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	go holder.Shutdown(ctx)
	deadline := time.After(15 * time.Second) // the poll is a minute away
	for {
		select {
		case ev := <-b.events:
			if ev.State == "completed" {
				return
			}
		case <-deadline:
			r := getRow(t, db, id)
			var w string
			db.QueryRow(context.Background(), `SELECT string_agg(waiter || ' ' || coalesce(woken_at::text, 'null') || ' ' || coalesce(polled_at::text, 'null') || ' exp ' || expires_at::text, '; ') FROM leash.waiters`).Scan(&w)
			t.Fatalf("the job handed back at shutdown did not complete within 15s: %+v; waiters %s", r, w)
		}
	}
}

// A job whose worker died (its lease expired, set so from SQL) is rescued and started by a
// waiting pool within about a rescue interval, though the poll is a minute away.
func TestRescuedJobReachesAWaitingPool(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	cfg.RescueInterval = 100 * time.Millisecond
	ps, b := fleet(t, db, 2, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.jobs (kind, state, attempt, lease_token, leased_by, lease_expires_at, attempted_at)
		VALUES ('noop', 'running', 1, nextval('leash.lease_tokens'), 'dead', now() - interval '1 second', now())`); err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 1, 15*time.Second) // the poll is a minute away
}

// A schedule row inserted from SQL, into a pool whose schedule loop has found nothing due for a
// while (so it looks before it opens a pass), fires from its next tick.
func TestScheduleFromSQLOnAnIdleWorker(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.ScheduleInterval = 200 * time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	start(t, p)
	waitPickable(t, db, 1)
	// Several schedule intervals with nothing due.
	time.Sleep(600 * time.Millisecond)
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.schedules (name, spec, kind) VALUES ('s', '@every 1s', 'noop')`); err != nil {
		t.Fatal(err)
	}
	// The next tick is a second after a worker first sees the row: at most one interval plus one
	// second, and the job's pickup.
	b.events.wait(t, 1, 2*time.Second)
}

// Pools with different queue sets poll as one per queue: a delayed job (announced by nothing)
// in the queue only one small pool serves is found by the next polls once due.
func TestDifferentQueueSetsFindADelayedJob(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	var ps []*pool.Pool
	b := &bundle{db: db, events: make(events, 1000)}
	for _, qs := range [][]string{{"a", "b"}, {"a"}, {"a"}, {"b"}, {"a", "b"}} {
		c := cfg
		c.Queues, c.Observer = qs, b.events
		p, _ := setup(t, db, c, map[string]pool.Handler{"noop": noop()})
		start(t, p)
		ps = append(ps, p)
	}
	waitPickable(t, db, 7)
	settle(t, ps)
	for _, q := range []string{"a", "b"} {
		insert(t, db, "noop", nil, &pool.InsertOpts{Queue: q, Delay: 300 * time.Millisecond})
		b.events.wait(t, 1, 10*time.Second) // the next polls once due; a loaded machine polls late
	}
}

// Every listener drops with jobs inserted at once: the registrations still read as pickable until
// refreshed, so the wakes go nowhere, and the deaf pools' polls claim (they are never covered).
func TestListenersDropThenInsert(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = 300 * time.Millisecond
	// The listeners stay away far longer than the jobs may wait: only the polls can claim them.
	cfg.ListenReconnectDelay = time.Minute
	ps, b := fleet(t, db, 3, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	if _, err := db.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = $1 AND datname = current_database()`, notify.ApplicationName); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		insert(t, db, "noop", nil, nil)
		b.events.wait(t, 1, 10*time.Second) // a few polls; a loaded machine's claims are slow
	}
}

// A registration forged with a poll time in the future covers nothing: the pool's own polls
// claim, and a delayed job (announced by nothing) is found at the first poll once due.
func TestFuturePollTimeCoversNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.waiters (queue, waiter, expires_at, wake_channel, slots, woken_at, polled_at)
		VALUES ('default', 'future', now() + interval '1 hour', 'leash_wake_00000000000000ff', 1, '-infinity', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	p, b := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	p.SetOwnPollEvery(1 << 30)
	start(t, p)
	waitPickable(t, db, 1)
	settle(t, []*pool.Pool{p})
	insert(t, db, "noop", nil, &pool.InsertOpts{Delay: 300 * time.Millisecond})
	// Covered by the forged registration, the job would wait an hour; a loaded machine's first
	// polls once it is due may be slow.
	b.events.wait(t, 1, 10*time.Second)
}

// A backlog of a queue capped at one running job, on a pool that waits for wake-ups: each
// completion makes the next job claimable, and no insert announces it (the trigger held back
// its notification while the queue was at its cap). The pool woken for the first job must claim
// the next one as the slot frees, not leave each to a poll.
func TestCappedBacklogOfAWaitingPoolDrains(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.Concurrency = 4
	cfg.PollInterval = time.Minute
	if err := pool.SetQueueMaxRunning(ctx, db, "default", 1); err != nil {
		t.Fatal(err)
	}
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	const jobs = 5
	insertMany(t, db, "default", "noop", jobs)
	// Back to back, five noop jobs take milliseconds; one per poll, four minutes.
	b.events.wait(t, jobs, 15*time.Second)
}
