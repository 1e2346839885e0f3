package pool_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/faultproxy"
	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// proxied returns a pool on the same database as url, reached through a fault proxy.
func proxied(t *testing.T, url string) (*pgxpool.Pool, *faultproxy.Proxy) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	px, err := faultproxy.New(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(px.Close)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(px.Port())
	cfg.MaxConns = 12
	db, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return db, px
}

func TestLongJobCompletesOnOneClaim(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 1500*time.Millisecond, 250*time.Millisecond
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"long": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		return pool.Sleep(ctx, 3*cfg.LeaseDuration)
	})})
	id := insert(t, b.db, "long", nil, nil)
	start(t, p)
	if ev := b.events.wait(t, 1, 20*time.Second)[0]; ev.State != "completed" {
		t.Fatalf("event %+v", ev)
	}
	if r := getRow(t, b.db, id); r.State != "completed" || r.Attempt != 1 {
		t.Fatalf("row %+v", r)
	}
	if p.Stats().Lease.RenewalsSucceeded < 3 || p.Stats().Lease.RenewalsLost != 0 || p.Stats().Lease.EndedTimeout != 0 {
		t.Fatalf("renewals ok=%d lost=%d timeouts=%d", p.Stats().Lease.RenewalsSucceeded, p.Stats().Lease.RenewalsLost, p.Stats().Lease.EndedTimeout)
	}
}

// A worker cut off from the database stops its handler with ErrRenewalTimeout while its lease is
// still unexpired on the database clock.
func TestCutOffWorkerStopsBeforeLeaseExpires(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	direct := pgtest.PoolFor(t, url)
	viaProxy, px := proxied(t, url)
	type seen struct {
		cause     error
		unexpired bool
		running   bool
		err       error
	}
	got := make(chan seen, 1)
	started := make(chan struct{})
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 2*time.Second, 300*time.Millisecond
	p, _ := setup(t, viaProxy, cfg, map[string]pool.Handler{"work": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		close(started)
		<-ctx.Done()
		var s seen
		s.cause = context.Cause(ctx)
		// Ask the database (directly, not through the cut) at the moment of cancellation.
		s.err = direct.QueryRow(context.Background(),
			`SELECT lease_expires_at > now(), state = 'running' AND lease_token = $2 FROM leash.jobs WHERE id = $1`,
			j.ID, j.Token).Scan(&s.unexpired, &s.running)
		got <- s
		return s.cause
	})})
	insert(t, direct, "work", nil, nil)
	start(t, p)
	<-started
	px.Cut()
	s := <-got
	healthy := p.Healthy()
	px.Heal()
	if s.err != nil {
		t.Fatal(s.err)
	}
	if !errors.Is(s.cause, lease.ErrRenewalTimeout) {
		t.Fatalf("cause %v, want ErrRenewalTimeout", s.cause)
	}
	if !s.unexpired || !s.running {
		t.Fatalf("handler stopped only after its lease expired on the database clock (unexpired=%v running=%v)", s.unexpired, s.running)
	}
	if healthy {
		t.Fatal("renewals fail but the keeper reports healthy: the pool would go on claiming")
	}
}

// A worker whose renewals stall is taken over with a new token; its late writes are rejected and
// the job completes once, at attempt 2, with exactly one fenced side effect.
func TestTakeoverFencesStaleHolder(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	direct := pgtest.PoolFor(t, url)
	viaProxy, px := proxied(t, url)
	ctx := context.Background()
	if _, err := direct.Exec(ctx, `CREATE TABLE ledger (job_id bigint, token bigint, worker text)`); err != nil {
		t.Fatal(err)
	}
	// effect writes the job's side effect under its fence, in the pool the handler's worker uses.
	effect := func(ctx context.Context, db *pgxpool.Pool, j *pool.Job, worker string) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := j.Fence(ctx, tx); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, $2, $3)`, j.ID, j.Token, worker)
			return err
		})
	}
	aStarted, aCancelled, healed := make(chan int64, 1), make(chan error, 1), make(chan struct{})
	aFenceErr := make(chan error, 1)
	cfg := fastConfig()
	cfg.ID = "A"
	cfg.LeaseDuration, cfg.HeartbeatInterval = 2*time.Second, 300*time.Millisecond
	a, _ := setup(t, viaProxy, cfg, map[string]pool.Handler{"work": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		aStarted <- j.Token
		<-ctx.Done()
		aCancelled <- context.Cause(ctx)
		<-healed
		// A stale holder that carries on regardless: its fenced effect must fail.
		aFenceErr <- effect(context.Background(), viaProxy, j, "A")
		return nil
	})})
	insert(t, direct, "work", nil, nil)
	start(t, a)
	oldToken := <-aStarted
	px.Hold() // A's renewals (and everything else A sends) now hang

	cfgB := fastConfig()
	cfgB.ID = "B"
	cfgB.LeaseDuration, cfgB.HeartbeatInterval = 2*time.Second, 300*time.Millisecond
	var bRuns atomic.Int32
	b, bb := setup(t, direct, cfgB, map[string]pool.Handler{"work": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		bRuns.Add(1)
		return effect(ctx, direct, j, "B")
	})})
	start(t, b)
	if cause := <-aCancelled; !errors.Is(cause, lease.ErrRenewalTimeout) {
		t.Fatalf("A's cause %v", cause)
	}
	if ev := bb.events.wait(t, 1, 20*time.Second)[0]; ev.State != "completed" {
		t.Fatalf("B's outcome %+v", ev)
	}
	px.Heal()
	close(healed)
	if err := <-aFenceErr; !errors.Is(err, pool.ErrFenced) {
		t.Fatalf("A's late effect: %v, want ErrFenced", err)
	}
	waitFor(t, 10*time.Second, func() bool { return a.Stats().StaleWrites == 1 })

	var id int64
	var state string
	var attempt int
	direct.QueryRow(ctx, `SELECT id, state, attempt FROM leash.jobs`).Scan(&id, &state, &attempt)
	if state != "completed" || attempt != 2 || bRuns.Load() != 1 {
		t.Fatalf("job %d %s at attempt %d, B ran %d times", id, state, attempt, bRuns.Load())
	}
	rows, _ := direct.Query(ctx, `SELECT worker, token FROM ledger`)
	type entry struct {
		Worker string
		Token  int64
	}
	ledger, err := pgx.CollectRows(rows, pgx.RowToStructByPos[entry])
	if err != nil {
		t.Fatal(err)
	}
	if len(ledger) != 1 || ledger[0].Worker != "B" || ledger[0].Token == oldToken {
		t.Fatalf("ledger %+v (old token %d)", ledger, oldToken)
	}
}

// A takeover notifies the old holder, which checks the row and stops at once with ErrLost rather
// than at its next renewal (a minute away here), even when it has claimed the job again meanwhile.
func TestTakeoverNotificationStopsOldHolder(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval, cfg.RescueInterval = 2*time.Minute, time.Minute, time.Hour
	started := make(chan struct{})
	cause := make(chan error, 1)
	var first sync.Once
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"work": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		isFirst := false
		first.Do(func() { isFirst = true; close(started) })
		<-ctx.Done()
		if isFirst {
			cause <- context.Cause(ctx) // the claim that was taken over; a later claim just waits
		}
		return context.Cause(ctx)
	})})
	id := insert(t, b.db, "work", nil, nil)
	start(t, p)
	<-started
	waitFor(t, 10*time.Second, p.ListenerConnected)
	ctx := context.Background()
	// Expire the lease and rescue it in one transaction, so that no renewal lands in between
	// (the listener's connect asks for one).
	err := pgx.BeginFunc(ctx, b.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, id); err != nil {
			return err
		}
		rescued, err := (&leasekeeper.Rescuer{DB: tx, Interval: time.Hour}).RunOnce(ctx)
		if err == nil && (len(rescued) != 1 || rescued[0].State != "retryable") {
			err = fmt.Errorf("rescued %+v", rescued)
		}
		return err
	})
	if err != nil {
		t.Fatalf("rescue: %v", err)
	}
	select {
	case c := <-cause:
		if !errors.Is(c, lease.ErrLost) {
			t.Fatalf("cause %v", c)
		}
	case <-time.After(20 * time.Second): // the next renewal is a minute away
		t.Fatal("old holder not stopped by the takeover notification")
	}
}

// A job that kills its worker process every time ends failed after max_attempts instead of
// looping forever.
func TestCrashingJobFailsAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	queue := "crashq"
	id := insert(t, db, "crash", nil, &pool.InsertOpts{Queue: queue, MaxAttempts: 3})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	crashes := 0
	for i := 0; i < 10; i++ {
		if r := getRow(t, db, id); r.State == "failed" {
			break
		}
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), "LEASH_HELPER_DB="+url, "LEASH_HELPER_QUEUES="+queue, fmt.Sprintf("LEASH_HELPER_ID=%d", i))
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		// The helper rescues the lease its predecessor left behind and crashes on the job again,
		// or, once attempts are used up, its rescuer fails the job and it has nothing to crash on.
		tick := time.NewTicker(20 * time.Millisecond)
		deadline := time.After(20 * time.Second)
	wait:
		for {
			select {
			case err := <-exited:
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != 3 {
					t.Fatalf("helper exited with %v, want the job's crash (3)", err)
				}
				crashes++
				break wait
			case <-tick.C:
				if getRow(t, db, id).State == "failed" {
					cmd.Process.Kill()
					<-exited
					break wait
				}
			case <-deadline:
				cmd.Process.Kill()
				t.Fatalf("helper neither crashed on the job nor failed it: %+v", getRow(t, db, id))
			}
		}
		tick.Stop()
	}
	r := getRow(t, db, id)
	if r.State != "failed" || r.Attempt != 3 || crashes != 3 {
		t.Fatalf("row %+v after %d crashes", r, crashes)
	}
	if !strings.Contains(*r.LastError, "lease expired") {
		t.Fatalf("last error %q", *r.LastError)
	}
}

// countingTracer counts renewal statements sent through a pool.
type countingTracer struct{ renewals atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "SET lease_expires_at = now()") {
		c.renewals.Add(1)
	}
	return ctx
}
func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func TestOneRenewalStatementForAllLeases(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	pcfg, _ := pgxpool.ParseConfig(url)
	tracer := &countingTracer{}
	pcfg.ConnConfig.Tracer = tracer
	db, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	const n = 100
	release := make(chan struct{})
	var running atomic.Int32
	cfg := fastConfig()
	cfg.Concurrency = n
	cfg.LeaseDuration, cfg.HeartbeatInterval = 2*time.Second, 200*time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{"hold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		running.Add(1)
		<-release
		return nil
	})})
	params := make([]pool.InsertManyParams, n)
	for i := range params {
		params[i].Kind = "hold"
	}
	if _, err := pool.InsertMany(context.Background(), db, params); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	waitFor(t, 20*time.Second, func() bool { return running.Load() == n })
	// Three heartbeats' worth of renewals: three statements, each for all n leases.
	before, renewedBefore := tracer.renewals.Load(), p.Stats().Lease.RenewalsSucceeded
	waitFor(t, 20*time.Second, func() bool { return p.Stats().Lease.RenewalsSucceeded-renewedBefore >= 3*n })
	renewed := p.Stats().Lease.RenewalsSucceeded - renewedBefore
	// One statement may be in flight at either end of the window (counted by the tracer when
	// sent, by the metric when confirmed).
	if got := tracer.renewals.Load() - before; got < renewed/n-1 || got > renewed/n+1 {
		t.Fatalf("%d renewal statements renewed %d leases of %d: want one statement per heartbeat for all", got, renewed, n)
	}
	close(release)
	b.events.wait(t, n, 20*time.Second)
}

func TestFenceRejectsStaleToken(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	insert(t, db, "k", nil, nil)
	claim := func() store.ClaimedJob {
		jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: 1, WorkerID: "t", Lease: time.Minute})
		if err != nil || len(jobs) != 1 {
			t.Fatalf("claim: %v, %v", jobs, err)
		}
		return jobs[0]
	}
	first := claim()
	db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'`)
	if got, err := store.Rescue(ctx, db, 10); err != nil || len(got) != 1 || got[0].OldToken != first.Token {
		t.Fatalf("rescue %+v, %v", got, err)
	}
	second := claim()
	if second.Token == first.Token || second.Attempt != 2 {
		t.Fatalf("second claim %+v", second)
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return store.Fence(ctx, tx, first.ID, first.Token) })
	if !errors.Is(err, store.ErrFenced) {
		t.Fatalf("stale fence: %v", err)
	}
	if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return store.Fence(ctx, tx, second.ID, second.Token) }); err != nil {
		t.Fatalf("live fence: %v", err)
	}
	written, err := store.Finish(ctx, db, []store.Outcome{{ID: first.ID, Token: first.Token, State: store.StateCompleted}})
	if err != nil || len(written) != 0 {
		t.Fatalf("stale finish wrote %v, %v", written, err)
	}
	if err := store.SetProgress(ctx, db, first.ID, first.Token, []byte(`1`)); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("stale progress: %v", err)
	}
}

func TestCompleteTxCommitsWithEffect(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	db.Exec(ctx, `CREATE TABLE effects (job_id bigint)`)
	p, b := setup(t, db, fastConfig(), map[string]pool.Handler{"tx": pool.Args(func(ctx context.Context, j *pool.Job, a struct{ Rollback bool }) error {
		tx, err := db.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := j.Fence(ctx, tx); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
			return err
		}
		if err := j.CompleteTx(ctx, tx); err != nil {
			return err
		}
		if a.Rollback {
			return errors.New("rolled back on purpose")
		}
		return tx.Commit(ctx)
	})})
	committed := insert(t, db, "tx", map[string]bool{"Rollback": false}, nil)
	rolledBack := insert(t, db, "tx", map[string]bool{"Rollback": true}, &pool.InsertOpts{MaxAttempts: 1})
	start(t, p)
	b.events.wait(t, 2, 10*time.Second)
	effects := func(id int64) (n int) {
		db.QueryRow(ctx, `SELECT count(*) FROM effects WHERE job_id = $1`, id).Scan(&n)
		return n
	}
	if r := getRow(t, db, committed); r.State != "completed" || effects(committed) != 1 {
		t.Fatalf("committed: %+v, %d effects", r, effects(committed))
	}
	if r := getRow(t, db, rolledBack); r.State != "failed" || effects(rolledBack) != 0 {
		t.Fatalf("rolled back: %+v, %d effects", r, effects(rolledBack))
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d stale writes", n)
	}
}

// A handler that completed its job inside its own transaction (CompleteTx) and returned nil has
// nothing left for the worker to write. If that transaction did not take (here it is rolled back
// and the error swallowed; after a failover to an asynchronous standby it is simply gone), the job
// must not be completed without its effect: its lease runs out and it runs again.
func TestCompletedInTxIsNotWrittenAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	db.Exec(ctx, `CREATE TABLE effects (job_id bigint)`)
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.RescueInterval = time.Second, 100*time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{"tx": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := j.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
				return err
			}
			if err := j.CompleteTx(ctx, tx); err != nil {
				return err
			}
			if j.Attempt == 1 {
				return errors.New("lost")
			}
			return nil
		})
		if j.Attempt == 1 {
			return nil // the loss goes unnoticed
		}
		return err
	})})
	id := insert(t, db, "tx", nil, nil)
	start(t, p)
	b.events.wait(t, 2, 15*time.Second)
	var n int
	db.QueryRow(ctx, `SELECT count(*) FROM effects WHERE job_id = $1`, id).Scan(&n)
	if r := getRow(t, db, id); r.State != "completed" || r.Attempt != 2 || n != 1 {
		t.Fatalf("job %+v with %d effects; want completed on attempt 2 with its effect", r, n)
	}
}

func TestProgressAndStalledHandler(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.StallInterval = 50 * time.Millisecond
	progressed := make(chan struct{})
	release := make(chan struct{})
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"stubborn": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		if err := j.SetProgress(ctx, map[string]int{"step": 3}); err != nil {
			return err
		}
		close(progressed)
		<-release // ignores ctx
		if err := j.SetProgress(context.Background(), map[string]int{"step": 4}); !errors.Is(err, pool.ErrFenced) {
			return fmt.Errorf("progress after revocation: %v", err)
		}
		return nil
	})})
	id := insert(t, b.db, "stubborn", nil, nil)
	start(t, p)
	<-progressed
	if r := getRow(t, b.db, id); string(r.Progress) != `{"step": 3}` {
		t.Fatalf("progress %s", r.Progress)
	}
	var ok bool
	b.db.QueryRow(context.Background(), `SELECT leash.revoke_job($1, 'stop')`, id).Scan(&ok)
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Stalled == 1 })
	close(release)
	b.events.wait(t, 1, 10*time.Second)
	// It returned nil, but only after the revocation reached it: revoked wins.
	if r := getRow(t, b.db, id); r.State != "cancelled" || !r.Revoked || string(r.Progress) != `{"step": 3}` {
		t.Fatalf("row %+v", r)
	}
}
