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
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// deafListener points the pool's listener at a port nobody listens on: no notification ever
// arrives, so only the row can tell the worker anything.
func deafListener(t *testing.T, cfg *pool.Config) {
	t.Helper()
	lc, err := pgx.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	cfg.ListenConfig = lc
}

// A revocation is never undone by the handler failing before the worker hears of it: the
// failing outcome lands on a revoked row and the job ends cancelled, never to run again.
func TestRevocationNotUndoneByFailingHandler(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"error", "panic", "retry-after", "revoke-by-update"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			cfg := fastConfig()
			cfg.LeaseDuration, cfg.HeartbeatInterval = time.Minute, 20*time.Second // renewals cannot see it in time
			deafListener(t, &cfg)
			started, fail := make(chan struct{}, 10), make(chan struct{})
			var runs atomic.Int32
			p, b := setup(t, nil, cfg, map[string]pool.Handler{"k": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
				runs.Add(1)
				started <- struct{}{}
				<-fail
				switch how {
				case "panic":
					panic("x")
				case "retry-after":
					return pool.RetryAfter(0, errors.New("x"))
				}
				return errors.New("x")
			})})
			id := insert(t, b.db, "k", nil, &pool.InsertOpts{MaxAttempts: 5})
			start(t, p)
			<-started
			if how == "revoke-by-update" {
				mustExec(t, b.db, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1`, id)
			} else {
				var ok bool
				if err := b.db.QueryRow(context.Background(), `SELECT leash.revoke_job($1, 'stop')`, id).Scan(&ok); err != nil || !ok {
					t.Fatalf("revoke_job: %v %v", ok, err)
				}
			}
			close(fail)
			ev := b.events.wait(t, 1, 10*time.Second)[0]
			if ev.State != "cancelled" {
				t.Fatalf("outcome %s, want cancelled", ev.State)
			}
			r := getRow(t, b.db, id)
			if r.State != "cancelled" || r.Attempt != 1 || !r.Revoked || r.FinishedAt == nil {
				t.Fatalf("row %+v", r)
			}
			// Nothing claims it again (a poll interval is 100ms here).
			time.Sleep(5 * cfg.PollInterval)
			if n := runs.Load(); n != 1 {
				t.Fatalf("revoked job ran %d times", n)
			}
		})
	}
}

// One outcome the database would refuse (a webhook body with a NUL byte, invalid UTF-8, a huge
// message) never fails the batch it is in: the 99 completed jobs beside it are written once.
func TestHostileOutcomeDoesNotPoisonBatch(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Concurrency = 100
	cfg.Engine.FinishFlushInterval = 200 * time.Millisecond // one batch for all of them
	var runs sync.Map
	gate := make(chan struct{})
	var arrived atomic.Int32
	h := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		n, _ := runs.LoadOrStore(j.ID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		if arrived.Add(1) == 100 {
			close(gate)
		}
		<-gate
		if j.Kind == "evil" {
			return fmt.Errorf("500 Internal Server Error: \x00\xff%s", strings.Repeat("\x00", 100000))
		}
		if j.Kind == "evilpanic" {
			panic("\x00\xc3(")
		}
		return nil
	})
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"noop": h, "evil": h, "evilpanic": h})
	params := make([]pool.InsertManyParams, 100)
	for i := range params {
		params[i].Kind = "noop"
	}
	params[40].Kind, params[70].Kind = "evil", "evilpanic"
	params[40].Opts = &pool.InsertOpts{MaxAttempts: 1}
	params[70].Opts = &pool.InsertOpts{MaxAttempts: 1}
	if _, err := pool.InsertMany(context.Background(), b.db, params); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	evs := b.events.wait(t, 100, 20*time.Second)
	states := map[string]int{}
	for _, ev := range evs {
		states[ev.State]++
	}
	if states["completed"] != 98 || states["failed"] != 2 {
		t.Fatalf("outcomes %v", states)
	}
	runs.Range(func(k, v any) bool {
		if n := v.(*atomic.Int32).Load(); n != 1 {
			t.Errorf("job %v ran %d times", k, n)
		}
		return true
	})
	var last string
	b.db.QueryRow(context.Background(), `SELECT last_error FROM leash.jobs WHERE kind = 'evil'`).Scan(&last)
	if !strings.HasPrefix(last, "500 Internal Server Error: \uFFFD\uFFFD") || !utf8.ValidString(last) || len(last) > 20000 {
		t.Fatalf("last_error %q", last[:min(60, len(last))])
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d outcomes dropped", n)
	}
}

// Handlers that hold every connection of the application's pool cannot starve the lease
// protocol: claims, renewals and outcomes have connections of their own.
func TestHandlersCannotStarveRenewals(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	pc.MaxConns = 2
	db, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = time.Second, 200*time.Millisecond
	release := make(chan struct{})
	var holding atomic.Int32
	causes := make(chan error, 10)
	p, b := setup(t, db, cfg, map[string]pool.Handler{"hog": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		conn, err := db.Acquire(ctx)
		if err != nil {
			causes <- context.Cause(ctx)
			return err
		}
		defer conn.Release()
		holding.Add(1)
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			causes <- context.Cause(ctx)
			return context.Cause(ctx)
		}
	})})
	for range 4 {
		insert(t, db, "hog", nil, nil)
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return holding.Load() == 2 })
	// Three lease durations with the application's pool exhausted.
	select {
	case c := <-causes:
		t.Fatalf("a handler lost its lease while others held the pool: %v", c)
	case <-time.After(3 * cfg.LeaseDuration):
	}
	close(release)
	evs := b.events.wait(t, 4, 20*time.Second)
	for _, ev := range evs {
		if ev.State != "completed" {
			t.Fatalf("event %+v", ev)
		}
	}
}

// A handler's fenced transaction that lasts several leases keeps its job's lease all along: the
// fence does not hold the row against renewals, so the job is renewed as usual and neither
// times out nor runs again, and its completion commits once. The other leases are not disturbed,
// and a checkpoint written beside the transaction goes through at once.
func TestLongFencedTransactionKeepsItsLease(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval, cfg.RescueInterval = time.Second, 200*time.Millisecond, 100*time.Millisecond
	db := pgtest.Pool(t)
	ctx := context.Background()
	mustExec(t, db, `CREATE TABLE effects (job_id bigint)`)
	release := make(chan struct{})
	progressErr := make(chan error, 1)
	ended := make(chan error, 10)
	var othersRunning, fencedRuns atomic.Int32
	p, b := setup(t, db, cfg, map[string]pool.Handler{
		"fenced": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			fencedRuns.Add(1)
			return pgx.BeginFunc(context.Background(), db, func(tx pgx.Tx) error {
				if err := j.Fence(ctx, tx); err != nil {
					return err
				}
				if err := j.SetProgressTx(ctx, tx, map[string]string{"step": "in tx"}); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
					return err
				}
				progressErr <- j.SetProgress(context.Background(), "beside")
				select {
				case <-release: // a slow business transaction, several leases long
				case <-ctx.Done():
					ended <- fmt.Errorf("fenced job: %w", context.Cause(ctx))
					return context.Cause(ctx)
				}
				return j.CompleteTx(ctx, tx)
			})
		}),
		"other": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			othersRunning.Add(1)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				ended <- context.Cause(ctx)
				return context.Cause(ctx)
			}
		}),
	})
	fenced := insert(t, db, "fenced", nil, nil)
	for range 3 {
		insert(t, db, "other", nil, nil)
	}
	start(t, p)
	select {
	case err := <-progressErr:
		if err != nil {
			close(release)
			t.Fatalf("SetProgress beside the fenced transaction: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("SetProgress beside the fenced transaction hangs")
	}
	waitFor(t, 10*time.Second, func() bool { return othersRunning.Load() == 3 })
	// Only the wait inside the transaction must renew without a skip: the write beside it and the
	// commit each hold the row for a moment, and a renewal meeting them skips it, as it should.
	skippedBefore := p.Stats().Lease.RenewalsSkipped
	select {
	case c := <-ended:
		close(release)
		t.Fatalf("a lease ended during a fenced transaction: %v", c)
	case <-time.After(4 * cfg.LeaseDuration):
	}
	skippedDuring := p.Stats().Lease.RenewalsSkipped - skippedBefore
	var renewedAhead bool
	db.QueryRow(ctx, `SELECT lease_expires_at > now() + interval '500 milliseconds' FROM leash.jobs WHERE id = $1`, fenced).Scan(&renewedAhead)
	if !renewedAhead {
		close(release)
		t.Fatal("the fenced job's lease was not renewed during its transaction")
	}
	close(release)
	b.events.wait(t, 4, 20*time.Second)
	var n int
	db.QueryRow(ctx, `SELECT count(*) FROM effects WHERE job_id = $1`, fenced).Scan(&n)
	if r := getRow(t, db, fenced); r.State != "completed" || r.Attempt != 1 || n != 1 || fencedRuns.Load() != 1 ||
		string(r.Progress) != `{"step": "in tx"}` {
		t.Fatalf("fenced job %+v, %d effects, %d runs", r, n, fencedRuns.Load())
	}
	if skippedDuring != 0 {
		t.Fatalf("%d renewals skipped during the fenced transaction", skippedDuring)
	}
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d stale writes", n)
	}
}

// A job's timeout (its column, or the kind's default) cancels the handler with ErrTimeout and
// fails the attempt like an error; a handler that ignores it stops being renewed, so the job
// cannot stay running for ever.
func TestTimeouts(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval, cfg.RescueInterval = time.Second, 200*time.Millisecond, 100*time.Millisecond
	cfg.Timeouts = map[string]time.Duration{"kinddefault": 100 * time.Millisecond}
	causes := make(chan error, 10)
	deafRelease := make(chan struct{})
	t.Cleanup(func() { close(deafRelease) })
	wait := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return context.Cause(ctx)
	})
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"own": wait, "kinddefault": wait,
		"deaf": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error { <-deafRelease; return nil })})
	own := insert(t, b.db, "own", nil, &pool.InsertOpts{Timeout: 150 * time.Millisecond, MaxAttempts: 2})
	kd := insert(t, b.db, "kinddefault", nil, &pool.InsertOpts{MaxAttempts: 1})
	deaf := insert(t, b.db, "deaf", nil, &pool.InsertOpts{Timeout: 100 * time.Millisecond, MaxAttempts: 1})
	start(t, p)
	for range 3 { // own twice (2 attempts), kinddefault once
		select {
		case c := <-causes:
			if !errors.Is(c, pool.ErrTimeout) {
				t.Fatalf("cause %v", c)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no timeout")
		}
	}
	waitFor(t, 10*time.Second, func() bool {
		return getRow(t, b.db, own).State == "failed" && getRow(t, b.db, kd).State == "failed"
	})
	if r := getRow(t, b.db, own); r.Attempt != 2 || r.LastError == nil || !strings.Contains(*r.LastError, "timed out after 150ms") {
		t.Fatalf("row %+v", r)
	}
	// The deaf handler never returns: its lease is not renewed after the timeout and a rescuer
	// ends the job.
	waitFor(t, 10*time.Second, func() bool { return getRow(t, b.db, deaf).State == "failed" })
	if p.Stats().TimedOut != 4 {
		t.Fatalf("%d timeouts", p.Stats().TimedOut)
	}
}

// A forged takeover notification (anyone who can connect can send one) does not make a worker
// abandon its job: the claim is checked against the row.
func TestForgedTakeoverIgnored(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	j := h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	renewals := p.Stats().Lease.RenewalsSucceeded
	mustExec(t, b.db, `SELECT pg_notify('job_revoked', $1)`, fmt.Sprintf(`{"id":%d,"token":%d,"takeover":true}`, id, j.Token))
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Lease.RenewalsSucceeded > renewals })
	if err := j.EnsureActive(); err != nil {
		t.Fatalf("forged takeover ended the lease: %v", err)
	}
	// A real revocation still works, and its reason is recorded, cleaned.
	mustExec(t, b.db, `SELECT pg_notify('job_revoked', $1)`, fmt.Sprintf(`{"id":%d,"token":%d,"reason":"bad \u0000 batch"}`, id, j.Token))
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	b.events.wait(t, 1, 10*time.Second)
	var reason string
	b.db.QueryRow(context.Background(), `SELECT revoke_reason FROM leash.jobs WHERE id = $1`, id).Scan(&reason)
	if !strings.HasPrefix(reason, "bad ") || !strings.HasSuffix(reason, " batch") || strings.ContainsRune(reason, 0) {
		t.Fatalf("reason %q", reason)
	}
}

// Shutdown settles every outcome exactly once, however handlers race the end of the grace
// period: none blocks for ever, none is written twice.
func TestShutdownSettlesEveryOutcomeOnce(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Concurrency = 50
	cfg.ShutdownTimeout = 50 * time.Millisecond
	cfg.ShutdownStallWait = 75 * time.Millisecond
	var started atomic.Int32
	var returned atomic.Int32
	stopping := make(chan struct{})
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"late": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started.Add(1)
		defer returned.Add(1)
		// Ignore cancellation for a while around the stall deadline (counted from the start of
		// the shutdown, however late the last handler started), then return.
		<-stopping
		time.Sleep(time.Duration(100+j.ID%50) * time.Millisecond) // cancelled at 50 ms, abandoned from 125 ms
		return ctx.Err()
	})})
	for range 50 {
		insert(t, b.db, "late", nil, nil)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	waitFor(t, 10*time.Second, func() bool { return started.Load() == 50 })
	grace, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	close(stopping)
	p.Shutdown(grace)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool { return returned.Load() == 50 && p.Busy() == 0 })
	var handed, running, other int
	rows, _ := b.db.Query(context.Background(), `SELECT state, attempt FROM leash.jobs`)
	for rows.Next() {
		var st string
		var attempt int
		rows.Scan(&st, &attempt)
		switch {
		case st == "available" && attempt == 0:
			handed++
		case st == "running" && attempt == 1:
			running++ // abandoned to its lease
		default:
			other++
		}
	}
	if other != 0 || handed+running != 50 || int64(running) != p.Stats().Abandoned {
		t.Fatalf("handed back %d, abandoned %d (metric %d), other %d", handed, running, p.Stats().Abandoned, other)
	}
}
