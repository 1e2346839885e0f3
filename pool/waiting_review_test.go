package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A transaction an operator forgot in psql holds every row of leash.waiters locked. Inserts still
// wake the pool (the trigger skips locked rows, then notifies without a lock), and a job must
// still start within about a poll interval: the claim loop must not block on its registration.
func TestForgottenLockOnWaitersDelaysLittle(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM leash.waiters FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	// The pool's refresh at its next poll waits for the lock.
	waitFor(t, 5*time.Second, func() bool {
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%leash.waiters%'`).Scan(&n)
		return n > 0
	})
	insert(t, db, "noop", nil, nil)
	// Blocked on the lock, the claim loop would wait out the statement's 10 s timeout.
	b.events.wait(t, 1, 5*time.Second)
}

// The same with the forgotten transaction holding only the row of a waiter long gone, which
// every registration of every pool deletes on its way once it is ten minutes expired.
func TestForgottenLockOnADeadWaiterDelaysLittle(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	ps, b := fleet(t, db, 2, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	if _, err := db.Exec(ctx, `INSERT INTO leash.waiters (queue, waiter, expires_at)
		VALUES ('default', 'gone', now() - interval '10 minutes' + interval '500 milliseconds')`); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM leash.waiters WHERE waiter = 'gone' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, func() bool {
		var past bool
		db.QueryRow(ctx, `SELECT expires_at < now() - interval '10 minutes' FROM leash.waiters WHERE waiter = 'gone'`).Scan(&past)
		return past
	})
	// Two polls: every registration meets the locked row on its way (it used to wait for it,
	// up to the statement's 10 s timeout, with the claim loop behind it).
	time.Sleep(2 * cfg.PollInterval)
	insert(t, db, "noop", nil, nil)
	// Blocked on the lock, the claim loop would wait out the statement's 10 s timeout.
	b.events.wait(t, 1, 5*time.Second)
}

// A retry backoff that is not a whole number of milliseconds (jitter makes most of them so): the
// outcome stores run_at rounded up to the millisecond, while the claim loop of the pool that
// waits for wake-ups is woken after the backoff itself. The wake must not come before the retry
// is due, or the claim finds nothing and the retry waits for the poll, a minute away.
func TestRetryWithAFractionalBackoffIsPrompt(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 4
	cfg.PollInterval = time.Minute
	cfg.RetryBackoff = func(int) time.Duration { return 50*time.Millisecond + time.Nanosecond }
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"flaky": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
		if j.Attempt < 2 {
			return errors.New("not yet")
		}
		return nil
	})})
	settle(t, ps)
	for i := range 40 {
		insert(t, db, "flaky", nil, nil)
		deadline := time.After(15 * time.Second) // the poll is a minute away
	wait:
		for {
			select {
			case ev := <-b.events:
				if ev.State == "completed" {
					break wait
				}
			case <-deadline:
				t.Fatalf("job %d, retried after 50ms and 1ns, did not complete within 15s", i)
			}
		}
		waitPickable(t, db, 1)
	}
}

// A waiting pool woken for a job that sorts before the last job it claimed (a higher priority, an
// earlier run_at) soon after that claim: its claim past the cursor does not see the job, and
// nothing but the poll (a minute away) makes it look from the front again. Each job must start
// within a second.
func TestUrgentJobRightAfterAClaimOfAWaitingPool(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 4
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	for range 5 {
		insert(t, db, "noop", nil, nil)
		b.events.wait(t, 1, 15*time.Second)
		insert(t, db, "noop", nil, &pool.InsertOpts{Priority: -1})
		b.events.wait(t, 1, 15*time.Second) // the poll is a minute away
		waitPickable(t, db, 1)
		// Past the time between claims from the front (twenty times their cost), so that the next
		// plain job is claimed from the front.
		time.Sleep(100 * time.Millisecond)
	}
}

// Two jobs snoozed at once, for 20ms and for 300ms, their outcomes written in one batch: each must
// run again once due, though nothing announces either and the poll is a minute away.
func TestSnoozesOfOneBatchAreEachPrompt(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	cfg.Engine.FinishFlushInterval = 20 * time.Millisecond
	var runs atomic.Int64
	var both sync.WaitGroup
	both.Add(2)
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"snooze": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
		if runs.Add(1) > 2 {
			return nil
		}
		// Both first runs end together, so that one flush writes both outcomes.
		both.Done()
		both.Wait()
		var args struct{ MS int }
		if err := json.Unmarshal(j.Payload, &args); err != nil {
			return err
		}
		return pool.Snooze(time.Duration(args.MS) * time.Millisecond)
	})})
	settle(t, ps)
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.jobs (kind, payload) VALUES ('snooze', '{"MS": 20}'), ('snooze', '{"MS": 300}')`); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(15 * time.Second) // the poll is a minute away
	for done := 0; done < 2; {
		select {
		case ev := <-b.events:
			if ev.State == "completed" {
				done++
			}
		case <-deadline:
			t.Fatalf("of two jobs snoozed for 20ms and 300ms in one batch, %d completed within 15s", done)
		}
	}
}
