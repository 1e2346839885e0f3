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
