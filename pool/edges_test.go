package pool_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// runCounter counts handler starts per job.
type runCounter struct {
	mu   sync.Mutex
	runs map[int64]int
}

func (c *runCounter) start(id int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[int64]int{}
	}
	c.runs[id]++
	return c.runs[id]
}

func (c *runCounter) of(id int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[id]
}

// A row locked by someone else's transaction (an operator's SELECT ... FOR UPDATE) holds back
// only its own job's outcome: the others in the batch are written at once, and the locked one is
// written once the lock goes, each job run once.
func TestLockedRowHoldsBackOnlyItsOwnOutcome(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 10*time.Second, time.Second
	db := pgtest.Pool(t)
	release := make(chan struct{})
	var runs runCounter
	var running atomic.Int32
	p, b := setup(t, db, cfg, map[string]pool.Handler{"k": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		runs.start(j.ID)
		running.Add(1)
		<-release
		return nil
	})})
	var ids []int64
	for range 6 {
		ids = append(ids, insert(t, db, "k", nil, nil))
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return running.Load() == 6 })
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM leash.jobs WHERE id = $1 FOR UPDATE", ids[0]); err != nil {
		t.Fatal(err)
	}
	close(release)
	for _, ev := range b.events.wait(t, 5, 10*time.Second) {
		if ev.State != "completed" {
			t.Fatalf("event %+v", ev)
		}
	}
	if r := getRow(t, db, ids[0]); r.State != "running" {
		t.Fatalf("the locked job is %s while its row is locked", r.State)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 1, 10*time.Second)
	for _, id := range ids {
		if r := getRow(t, db, id); r.State != "completed" || r.Attempt != 1 || runs.of(id) != 1 {
			t.Fatalf("job %d: %+v, ran %d times", id, r, runs.of(id))
		}
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d outcomes dropped", n)
	}
}

type nilErr struct{ msg string }

func (e *nilErr) Error() string { return e.msg } // panics on a nil receiver

type loud struct{}

func (loud) String() string { panic(loud{}) } // printing it panics, and so does printing that

// Errors and panic values whose printing panics (a typed nil pointer, a String method that
// panics again) fail their attempt like any other error; the worker goes on.
func TestHandlerValuesThatPanicWhenPrinted(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{
		"typednil": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			var e *nilErr
			return e
		}),
		"loudpanic": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error { panic(loud{}) }),
		"noop":      noop(),
	})
	a := insert(t, b.db, "typednil", nil, &pool.InsertOpts{MaxAttempts: 1})
	c := insert(t, b.db, "loudpanic", nil, &pool.InsertOpts{MaxAttempts: 1})
	start(t, p)
	b.events.wait(t, 2, 10*time.Second)
	for _, id := range []int64{a, c} {
		if r := getRow(t, b.db, id); r.State != "failed" || r.LastError == nil || !strings.Contains(*r.LastError, "panic") {
			t.Fatalf("job %d: %+v", id, r)
		}
	}
	insert(t, b.db, "noop", nil, nil)
	if ev := b.events.wait(t, 1, 10*time.Second)[0]; ev.State != "completed" {
		t.Fatalf("worker after the bad values: %+v", ev)
	}
}

// A console revocation (bare NOTIFY) of a job whose handler is already stopping for another
// cause (its timeout, shutdown) is still recorded: the job ends cancelled and never runs again.
func TestConsoleRevocationOfStoppingJobIsDurable(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"timeout", "shutdown"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			cfg := fastConfig()
			cfg.Timeouts = map[string]time.Duration{"k": 200 * time.Millisecond}
			if how == "shutdown" {
				cfg.Timeouts = nil
				cfg.ShutdownTimeout, cfg.ShutdownStallWait = 100*time.Millisecond, 5*time.Second
			}
			db := pgtest.Pool(t)
			var runs runCounter
			stopping := make(chan struct{}, 10)
			proceed := make(chan struct{})
			p, b := setup(t, db, cfg, map[string]pool.Handler{"k": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
				if runs.start(j.ID) > 1 {
					return nil
				}
				<-ctx.Done()
				stopping <- struct{}{}
				<-proceed // cleaning up: the revocation arrives meanwhile
				return context.Cause(ctx)
			})})
			id := insert(t, db, "k", nil, &pool.InsertOpts{MaxAttempts: 5})
			done := make(chan error, 1)
			go func() { done <- p.Run(context.Background()) }()
			waitFor(t, 10*time.Second, p.ListenerConnected)
			waitFor(t, 10*time.Second, func() bool { return p.Busy() == 1 })
			if how == "shutdown" {
				sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
				defer cancel()
				go p.Shutdown(sctx)
			}
			<-stopping
			mustExec(t, db, fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
			waitFor(t, 10*time.Second, func() bool { return getRow(t, db, id).Revoked })
			close(proceed)
			if how == "timeout" {
				b.events.wait(t, 1, 10*time.Second)
				p.Shutdown(context.Background())
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if r := getRow(t, db, id); r.State != "cancelled" || runs.of(id) != 1 {
				t.Fatalf("row %+v, ran %d times", r, runs.of(id))
			}
		})
	}
}

// Many console revocations at once are all recorded in their rows, even while rows are briefly
// locked by others and handlers take longer than their lease to stop: none runs again.
func TestManyConsoleRevocationsAllRecorded(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Concurrency = 20
	cfg.LeaseDuration, cfg.HeartbeatInterval, cfg.RescueInterval = time.Second, 200*time.Millisecond, 100*time.Millisecond
	db := pgtest.Pool(t)
	var runs runCounter
	var first atomic.Int32
	release := make(chan struct{})
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"k": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		if runs.start(j.ID) > 1 {
			return nil
		}
		first.Add(1)
		<-ctx.Done()
		<-release // slow cleanup, past the lease
		return context.Cause(ctx)
	})})
	var ids []int64
	for range 10 {
		ids = append(ids, insert(t, db, "k", nil, nil))
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return first.Load() == 10 })
	waitFor(t, 10*time.Second, p.ListenerConnected)
	ctx := context.Background()
	lock, err := db.Begin(ctx) // a report holding the rows for a moment
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, "SELECT 1 FROM leash.jobs WHERE state = 'running' FOR SHARE"); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		for _, id := range ids {
			if _, err := tx.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", id)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the report keeps its lock a little longer
	lock.Rollback(ctx)
	waitFor(t, 10*time.Second, func() bool {
		var n int
		db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE revoked_at IS NOT NULL").Scan(&n)
		return n == 10
	})
	close(release)
	waitFor(t, 20*time.Second, func() bool {
		var n int
		db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE state = 'cancelled'").Scan(&n)
		return n == 10
	})
	for _, id := range ids {
		if n := runs.of(id); n != 1 {
			t.Fatalf("revoked job %d ran %d times", id, n)
		}
	}
}

// revoke_job takes reasons of any length and bytes; the notification carries a bounded part of
// it, so the holder is told at once (the heartbeat here is 20s away).
func TestRevokeJobWithLongReason(t *testing.T) {
	t.Parallel()
	for _, reason := range []string{strings.Repeat("x", 8000), strings.Repeat("\x01", 1400), strings.Repeat("é", 3000)} {
		h := newBlocker()
		p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"k": h})
		id := insert(t, b.db, "k", nil, nil)
		start(t, p)
		h.next(t)
		waitFor(t, 10*time.Second, p.ListenerConnected)
		var ok bool
		if err := b.db.QueryRow(context.Background(), "SELECT leash.revoke_job($1, $2)", id, reason).Scan(&ok); err != nil || !ok {
			t.Fatalf("revoke_job with a %d-byte reason: %v %v", len(reason), ok, err)
		}
		if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
			t.Fatalf("cause %v", c.cause)
		}
		if n := p.Stats().Listener.Malformed; n != 0 {
			t.Fatalf("%d notifications refused as malformed", n)
		}
	}
}

// Shutdown before Run: Run claims nothing.
func TestShutdownBeforeRunClaimsNothing(t *testing.T) {
	t.Parallel()
	var started atomic.Int32
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"k": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started.Add(1)
		return nil
	})})
	for range 5 {
		insert(t, b.db, "k", nil, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p.Shutdown(ctx)
	if err := p.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if started.Load() != 0 || p.Stats().Claimed != 0 {
		t.Fatalf("started %d, claimed %d after shutdown", started.Load(), p.Stats().Claimed)
	}
}

// Console revocations of jobs whose rows are held by their own long fenced transactions do not
// take the control connections from the renewals of every other lease.
func TestRecordingRevocationsDoesNotStarveRenewals(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 3*time.Second, 500*time.Millisecond
	db := pgtest.Pool(t)
	var fenced, others atomic.Int32
	lost := make(chan error, 100)
	hold := make(chan struct{})
	p, _ := setup(t, db, cfg, map[string]pool.Handler{
		"fenced": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			return pgx.BeginFunc(context.Background(), db, func(tx pgx.Tx) error {
				if err := j.Fence(ctx, tx); err != nil {
					return err
				}
				fenced.Add(1)
				<-hold // a slow business transaction
				return nil
			})
		}),
		"other": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			others.Add(1)
			select {
			case <-ctx.Done():
				lost <- context.Cause(ctx)
				return context.Cause(ctx)
			case <-hold:
				return nil
			}
		}),
	})
	var victims []int64
	for range 6 {
		victims = append(victims, insert(t, db, "fenced", nil, nil))
	}
	for range 4 {
		insert(t, db, "other", nil, nil)
	}
	start(t, p)
	t.Cleanup(func() { close(hold) })
	waitFor(t, 10*time.Second, func() bool { return fenced.Load() == 6 && others.Load() == 4 })
	waitFor(t, 10*time.Second, p.ListenerConnected)
	for _, id := range victims {
		mustExec(t, db, fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
	}
	select {
	case c := <-lost:
		t.Fatalf("an unrelated lease ended: %v (renewals failed %d)", c, p.Stats().Lease.RenewalsFailed)
	case <-time.After(2 * cfg.LeaseDuration):
	}
}

// A flood of forged takeover notifications costs a few renewal statements a second, not one
// each.
func TestForgedTakeoverFloodIsRateLimited(t *testing.T) {
	t.Parallel()
	cfg := slowHeartbeat()
	cfg.Concurrency = 10
	h := newBlocker()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"k": h})
	for range 10 {
		insert(t, b.db, "k", nil, nil)
	}
	start(t, p)
	var j *pool.Job
	for range 10 {
		j = h.next(t)
	}
	waitFor(t, 10*time.Second, p.ListenerConnected)
	before := p.Stats().Lease.RenewalsSucceeded
	began := time.Now()
	payload := fmt.Sprintf(`{"id":%d,"token":%d,"takeover":true}`, j.ID, j.Token)
	err := pgx.BeginFunc(context.Background(), b.db, func(tx pgx.Tx) error {
		for i := range 1000 {
			if _, err := tx.Exec(context.Background(), "SELECT pg_notify('job_revoked', $1)", payload+strings.Repeat(" ", i)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Listener.Received >= 1000 })
	statements := (p.Stats().Lease.RenewalsSucceeded - before) / 10
	// RenewRetryInterval is 5s here, so kicks are spaced by the 250ms cap.
	if limit := int64(time.Since(began)/(250*time.Millisecond)) + 2; statements > limit {
		t.Fatalf("%d renewal statements for a flood of forged takeovers in %s (limit %d)", statements, time.Since(began), limit)
	}
	if err := j.EnsureActive(); err != nil {
		t.Fatalf("forged takeovers ended the lease: %v", err)
	}
}

// With OutcomesWithClaims, outcomes ride on the next claim's transaction: every job still ends
// once, a locked row still holds back only its own outcome.
func TestOutcomesWithClaims(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Engine.OutcomesWithClaims = true
	cfg.LeaseDuration, cfg.HeartbeatInterval = 10*time.Second, time.Second
	db := pgtest.Pool(t)
	var runs runCounter
	locked := make(chan struct{})
	p, b := setup(t, db, cfg, map[string]pool.Handler{
		"noop": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error { runs.start(j.ID); return nil }),
		"held": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error { runs.start(j.ID); <-locked; return nil }),
	})
	held := insert(t, db, "held", nil, nil)
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return p.Busy() == 1 })
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM leash.jobs WHERE id = $1 FOR UPDATE", held); err != nil {
		t.Fatal(err)
	}
	close(locked)
	params := make([]pool.InsertManyParams, 300)
	for i := range params {
		params[i].Kind = "noop"
	}
	if _, err := pool.InsertMany(ctx, db, params); err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 300, 20*time.Second)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 1, 10*time.Second)
	var n int
	db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE state = 'completed' AND attempt = 1").Scan(&n)
	if n != 301 {
		t.Fatalf("%d of 301 jobs completed at attempt 1", n)
	}
	for id, k := range runs.runs {
		if k != 1 {
			t.Fatalf("job %d ran %d times", id, k)
		}
	}
}
