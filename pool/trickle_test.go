package pool_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A trickle of jobs costs one claim each: the woken pool claims the job and goes on waiting for
// wake-ups (it re-arms), rather than polling its way back to waiting (WaitAfter's polls, the
// registration's re-checks) after every job.
func TestTrickleCostsOneClaimPerJob(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 4
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 2, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	before := claims(ps)
	const jobs = 20
	for range jobs {
		insert(t, db, "noop", nil, nil)
		b.events.wait(t, 1, 10*time.Second)
		waitPickable(t, db, 2)
		// Further apart than lightGap, so that the pool woken next waits still.
		time.Sleep(30 * time.Millisecond)
	}
	settle(t, ps)
	after := claims(ps)
	n := after[0] - before[0] + after[1] - before[1]
	if n > jobs+jobs/10 {
		t.Fatalf("%d jobs inserted one at a time cost %d claims, want at most %d", jobs, n, jobs+jobs/10)
	}
}

// A job that fails is retried as soon as its backoff has passed by a pool that waits for
// wake-ups, though nothing announces the retry then (the outcome's own notification is for a
// retry due at once) and the poll is a minute away.
func TestRetryOfAWaitingPoolIsPrompt(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	cfg.RetryBackoff = func(int) time.Duration { return 300 * time.Millisecond }
	var attempts atomic.Int64
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"flaky": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		if attempts.Add(1) < 3 {
			return errors.New("not yet")
		}
		return nil
	})})
	settle(t, ps)
	insert(t, db, "flaky", nil, nil)
	deadline := time.After(10 * time.Second)
	for {
		select {
		case ev := <-b.events:
			if ev.State == "completed" {
				return
			}
		case <-deadline:
			t.Fatalf("a job retried after 300ms twice did not complete within 10s (attempts %d)", attempts.Load())
		}
	}
}

// An idle fleet polls as one: a waiting pool whose queues another pool claimed for its poll
// within half a poll interval does not claim for its own, so six idle pools make far fewer
// claims than polls.
func TestIdleFleetPollsAsOne(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	const n = 6
	ps, _ := fleet(t, db, n, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	before, began := claims(ps), time.Now()
	time.Sleep(3 * time.Second)
	after, took := claims(ps), time.Since(began)
	var made int64
	for i := range ps {
		made += after[i] - before[i]
	}
	// Each pool polls every 160-200ms: at least n*took/200ms polls. One claim each would be as
	// many claims; polling as one, about one claim every 100-130ms for the fleet, plus every
	// tenth poll of each pool.
	polls := int64(n * took / cfg.PollInterval)
	if made > polls*6/10 {
		t.Fatalf("%d idle pools made %d claims in %s, about as many as their %d polls", n, made, took.Round(time.Millisecond), polls)
	}
	if made == 0 {
		t.Fatalf("%d idle pools made no claim in %s: nobody polls", n, took.Round(time.Millisecond))
	}
}

// coverPolls keeps a live registration on queue that claimed for a poll just now, as a forged
// row (or a very busy fleet) would: every poll of a pool on queue is covered.
func coverPolls(t *testing.T, db pool.DB, queue string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	if _, err := db.Exec(ctx, `INSERT INTO leash.waiters (queue, waiter, expires_at, wake_channel, slots, woken_at, polled_at)
		VALUES ($1, 'cover', now() + interval '1 hour', 'leash_wake_00000000000000cc', 1, '-infinity', now())`, queue); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			db.Exec(ctx, `UPDATE leash.waiters SET polled_at = now() WHERE waiter = 'cover'`)
			time.Sleep(20 * time.Millisecond)
		}
	}()
}

// A job no notification announces (here a delayed one) is found although forged poll times
// cover every poll of the pool's queue: every tenth poll claims regardless.
func TestForgedPollTimesDelayLittle(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	coverPolls(t, db, "default")
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	insert(t, db, "noop", nil, &pool.InsertOpts{Delay: 300 * time.Millisecond})
	// Due after 300ms, found by the tenth poll at the latest (2s), not by a wake.
	b.events.wait(t, 1, 8*time.Second)
}

// A queue resumed while the notification was lost, on a pool whose other queue's polls are
// covered: the pool reads the queue controls at its poll while one of its queues is paused, so
// the resumed queue's jobs start at the next poll, not at the pool's own claiming poll.
func TestResumeLostAtACoveredPoll(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	cfg.Queues = []string{"default", "b"}
	if _, err := pool.PauseQueue(ctx, db, "b"); err != nil {
		t.Fatal(err)
	}
	coverPolls(t, db, "default")
	p, b := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	p.SetOwnPollEvery(1 << 30)
	start(t, p)
	waitPickable(t, db, 1)
	settle(t, []*pool.Pool{p})
	// Resumed with no trigger firing: no queue_changed notification.
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SET session_replication_role = replica; UPDATE leash.queues SET paused_at = NULL WHERE name = 'b'; RESET session_replication_role`); err != nil {
		t.Fatal(err)
	}
	insert(t, db, "noop", nil, &pool.InsertOpts{Queue: "b"})
	b.events.wait(t, 1, 5*time.Second)
}

// A registration that fails for a while (here the waiting hint's lock held by another
// transaction past the registration's lock bound) is tried again soon after, backing off: the
// pool waits for wake-ups again within moments of the lock's release, not at its next poll.
func TestFailedRegistrationIsRetriedSoon(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.Concurrency = 1 // each job fills the pool: it unregisters and registers again after it
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM leash.waiting_hint_lock FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	insert(t, db, "noop", nil, nil)
	b.events.wait(t, 1, 10*time.Second)
	// Registrations fail meanwhile: the hint's trigger waits 1 s for the lock, then gives up.
	time.Sleep(3 * time.Second)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	waitPickable(t, db, 1)
	if d := time.Since(released); d > 5*time.Second {
		t.Fatalf("registered again %s after the lock was released", d.Round(time.Millisecond))
	}
}
