package pool_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/notify"
	"github.com/leashq/leash/pool"
)

// blocker is a handler that reports each start and waits for its context, reporting the cause.
type blocker struct {
	started chan *pool.Job
	causes  chan jobCause
}

type jobCause struct {
	id    int64
	cause error
	at    time.Time
}

func newBlocker() *blocker {
	return &blocker{started: make(chan *pool.Job, 1000), causes: make(chan jobCause, 1000)}
}

func (b *blocker) Handle(ctx context.Context, j *pool.Job) error {
	b.started <- j
	<-ctx.Done()
	b.causes <- jobCause{j.ID, context.Cause(ctx), time.Now()}
	return context.Cause(ctx)
}

func (b *blocker) next(t *testing.T) *pool.Job {
	t.Helper()
	select {
	case j := <-b.started:
		return j
	case <-time.After(20 * time.Second):
		t.Fatal("no job started")
		return nil
	}
}

func (b *blocker) cause(t *testing.T) jobCause {
	t.Helper()
	select {
	case c := <-b.causes:
		return c
	case <-time.After(20 * time.Second):
		t.Fatal("no job cancelled")
		return jobCause{}
	}
}

// slowHeartbeat makes renewals too rare to explain a fast revocation: only the channel can.
func slowHeartbeat() pool.Config {
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval, cfg.RescueInterval = time.Minute, 20*time.Second, time.Minute
	return cfg
}

func mustExec(t *testing.T, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func TestConsoleNotifyRevokesRunningJob(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	mustExec(t, b.db, fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	if ev := b.events.wait(t, 1, 10*time.Second)[0]; ev.State != "cancelled" {
		t.Fatalf("event %+v", ev)
	}
	var reason string
	if err := b.db.QueryRow(context.Background(), "SELECT coalesce(revoke_reason, '') FROM leash.jobs WHERE id = $1", id).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	r := getRow(t, b.db, id)
	if r.State != "cancelled" || !strings.Contains(*r.LastError, "revoked") || !strings.Contains(reason, "NOTIFY") {
		t.Fatalf("row %+v, reason %q", r, reason)
	}
	if p.Stats().RevokedByNotification != 1 {
		t.Fatal("not counted as revoked by notification")
	}
}

func TestRevokeJobRevokesRunningJob(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	mustExec(t, b.db, "SELECT leash.revoke_job($1, 'wrong customer')", id)
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	b.events.wait(t, 1, 10*time.Second)
	var reason string
	if err := b.db.QueryRow(context.Background(), "SELECT revoke_reason FROM leash.jobs WHERE id = $1", id).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if r := getRow(t, b.db, id); r.State != "cancelled" || !r.Revoked || reason != "wrong customer" {
		t.Fatalf("row %+v reason %q", r, reason)
	}
}

func TestRevokedQueuedJobNeverRuns(t *testing.T) {
	t.Parallel()
	var ran atomic.Int32
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"k": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		ran.Add(1)
		return nil
	})})
	revoked := insert(t, b.db, "k", nil, nil)
	mustExec(t, b.db, "SELECT leash.revoke_job($1)", revoked)
	later := insert(t, b.db, "k", nil, nil)
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	if getRow(t, b.db, later).State != "completed" || getRow(t, b.db, revoked).State != "cancelled" || ran.Load() != 1 {
		t.Fatalf("revoked queued job ran (%d runs)", ran.Load())
	}
}

func TestStaleTokenIgnored(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	cfg := slowHeartbeat()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": h})
	first := insert(t, b.db, "block", nil, nil)
	second := insert(t, b.db, "block", nil, nil)
	start(t, p)
	j1, j2 := h.next(t), h.next(t)
	if j1.ID != first {
		j1, j2 = j2, j1
	}
	waitFor(t, 10*time.Second, p.ListenerConnected)
	// A notification about an earlier claim of the first job, then a good one for the second:
	// notifications arrive in order, so once the second is cancelled the first was ignored.
	mustExec(t, b.db, "SELECT pg_notify('job_revoked', $1)", fmt.Sprintf(`{"id":%d,"token":%d,"reason":"stale"}`, first, j1.Token-1000))
	mustExec(t, b.db, "SELECT pg_notify('job_revoked', $1)", fmt.Sprintf(`{"id":%d,"token":%d}`, second, j2.Token))
	if c := h.cause(t); c.id != second || !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cancelled %d with %v", c.id, c.cause)
	}
	if err := j1.EnsureActive(); err != nil {
		t.Fatalf("stale token revoked the current claim: %v", err)
	}
}

func TestRevokeRequireRow(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	cfg := slowHeartbeat()
	cfg.RevokeRequireRow = true
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	j := h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	before := p.Stats().Lease.RenewalsSucceeded
	mustExec(t, b.db, fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
	// The notification makes the worker check the row, which says nothing: it keeps running.
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Lease.RenewalsSucceeded > before })
	if err := j.EnsureActive(); err != nil {
		t.Fatalf("a forged NOTIFY revoked the job: %v", err)
	}
	mustExec(t, b.db, "SELECT leash.revoke_job($1)", id)
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
}

// The listener's backend is killed and the revocation sent while it is down: the notification is
// lost, and the revocation still lands within about one heartbeat.
func TestRevocationLandsWithListenerDown(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 20*time.Second, time.Second
	cfg.ListenReconnectDelay = 10 * time.Second // far longer than a heartbeat: the renewal must find it
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	mustExec(t, b.db, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()", notify.ApplicationName)
	waitFor(t, 10*time.Second, func() bool { return !p.ListenerConnected() })
	sent := time.Now()
	mustExec(t, b.db, "SELECT leash.revoke_job($1, 'while deaf')", id)
	c := h.cause(t)
	// The cause says why, from the row's revoke_reason, as a notified revocation's does.
	if !errors.Is(c.cause, lease.ErrRevoked) || !strings.Contains(c.cause.Error(), "while deaf") {
		t.Fatalf("cause %v", c.cause)
	}
	// One heartbeat, and a second one's margin for a loaded machine: the listener is back only
	// after 10 s.
	if d := c.at.Sub(sent); d > 2*cfg.HeartbeatInterval+time.Second {
		t.Fatalf("revocation took %s with a %s heartbeat", d, cfg.HeartbeatInterval)
	}
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, b.db, id); r.State != "cancelled" || r.LastError == nil || !strings.Contains(*r.LastError, "while deaf") {
		t.Fatalf("row %+v", r)
	}
	if p.Stats().Lease.RevokedByRenewal+p.Stats().Lease.RevokedByRecheck != 1 || p.Stats().RevokedByNotification != 0 {
		t.Fatal("revocation not counted as found by renewal")
	}
}

func TestGarbageNotificationsLeaveWorkerWorking(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"noop": noop(), "block": h})
	blocked := insert(t, b.db, "block", nil, nil)
	start(t, p)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	junk := []string{"", "\t", "abc", "-1", "0", "1.5", "99999999999999999999999", `{"id":"1"}`, `{"id":1,"x":2}`,
		`{"id":`, `[1]`, `null`, `{"id":1,"token":-4}`, strings.Repeat("9", 7900), `{"id":1}{"id":2}`}
	// 10,000 distinct payloads (identical ones would be merged by PostgreSQL) in one transaction.
	mustExec(t, b.db, `SELECT pg_notify('job_revoked', CASE WHEN length(j) > 7000 THEN left(j, 7890) || i
	                                                    ELSE j || repeat(' ', i / $2) END),
	                      pg_notify('job_available', 'garbage-' || i)
	               FROM generate_series(0, 9999) i, LATERAL (SELECT ($1::text[])[(i % $2) + 1]) AS x(j)`, junk, len(junk))
	// After the flood, a good revocation and a new job are handled as usual.
	mustExec(t, b.db, fmt.Sprintf("NOTIFY job_revoked, '%d'", blocked))
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	b.events.wait(t, 1, 10*time.Second)
	good := insert(t, b.db, "noop", nil, nil)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, b.db, good); r.State != "completed" {
		t.Fatalf("worker stopped working: %+v", r)
	}
	if n := p.Stats().Listener.Malformed; n != 10000 {
		t.Fatalf("%d malformed counted, want 10000", n)
	}
}

// Revocation racing completion leaves exactly one final state per job.
func TestRevokeRacesComplete(t *testing.T) {
	t.Parallel()
	const n = 300
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Concurrency = 50
	p, b := setup(t, db, cfg, map[string]pool.Handler{"quick": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		// Finish at about the moment the revocation arrives; honour it if it came first.
		select {
		case <-time.After(time.Duration(j.ID%5) * time.Millisecond):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})})
	params := make([]pool.InsertManyParams, n)
	for i := range params {
		params[i].Kind = "quick"
	}
	pool.InsertMany(context.Background(), db, params)
	start(t, p)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := int64(w + 1); id <= n; id += 4 {
				var err error
				if id%2 == 0 {
					_, err = db.Exec(context.Background(), "SELECT leash.revoke_job($1, 'race')", id)
				} else {
					_, err = db.Exec(context.Background(), fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
				}
				if err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	// Jobs revoked before they were claimed are cancelled by the database and never reach the
	// pool, so wait on the table rather than on events.
	waitFor(t, 30*time.Second, func() bool {
		var open int
		if err := db.QueryRow(context.Background(), "SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'cancelled', 'failed')").Scan(&open); err != nil {
			t.Fatal(err)
		}
		return open == 0
	})
	_ = b
	rows, err := db.Query(context.Background(), `SELECT state, revoked_at IS NOT NULL, attempt, count(*) FROM leash.jobs GROUP BY 1, 2, 3`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var seen []string
	for rows.Next() {
		var state string
		var revoked bool
		var attempt, count int
		if err := rows.Scan(&state, &revoked, &attempt, &count); err != nil {
			t.Fatal(err)
		}
		seen = append(seen, fmt.Sprintf("%s revoked=%v attempt=%d: %d", state, revoked, attempt, count))
		switch {
		case state == "completed" && attempt == 1:
		case state == "cancelled" && revoked && attempt <= 1:
		default:
			t.Errorf("unexpected: %s revoked=%v attempt=%d (%d jobs)", state, revoked, attempt, count)
		}
	}
	slices.Sort(seen)
	t.Log(seen)
	if n := p.Stats().StaleWrites; n != 0 {
		t.Fatalf("%d stale writes", n)
	}
}

// stubbornFenced is a handler that fences its job in a transaction, writes a business row, waits
// for its context and then commits all the same, as a handler that ignores its cancellation
// would: the commit must fail once the job was revoked.
type stubbornFenced struct {
	db      *pgxpool.Pool
	started chan int64
	causes  chan error
	commits chan error
}

func newStubbornFenced(t *testing.T, db *pgxpool.Pool) *stubbornFenced {
	mustExec(t, db, `CREATE TABLE effects (job_id bigint)`)
	return &stubbornFenced{db: db, started: make(chan int64, 10), causes: make(chan error, 10), commits: make(chan error, 10)}
}

func (h *stubbornFenced) Handle(ctx context.Context, j *pool.Job) error {
	err := pgx.BeginFunc(context.Background(), h.db, func(tx pgx.Tx) error {
		if err := j.Fence(ctx, tx); err != nil {
			return err
		}
		if _, err := tx.Exec(context.Background(), `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
			return err
		}
		h.started <- j.ID
		<-ctx.Done()
		h.causes <- context.Cause(ctx)
		return nil // commit anyway
	})
	h.commits <- err
	return err
}

func (h *stubbornFenced) effects(t *testing.T, id int64) (n int) {
	t.Helper()
	if err := h.db.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE job_id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A revocation of a job inside its fenced transaction neither waits for that transaction nor
// loses to it, by revoke_job or by the console's UPDATE of revoked_at: the revocation returns at
// once, the handler is cancelled at once (the heartbeat is far too slow to explain it), its
// transaction's commit fails, and the job ends cancelled with nothing of the transaction
// committed.
func TestRevocationReachesFencedTransaction(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"revoke_job", "update"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			h := newStubbornFenced(t, db)
			p, b := setup(t, db, slowHeartbeat(), map[string]pool.Handler{"fenced": h})
			id := insert(t, db, "fenced", nil, nil)
			start(t, p)
			<-h.started
			waitFor(t, 10*time.Second, p.ListenerConnected)
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			sent := time.Now()
			var err error
			if how == "revoke_job" {
				_, err = db.Exec(rctx, `SELECT leash.revoke_job($1, 'stop it')`, id)
			} else {
				_, err = db.Exec(rctx, `UPDATE leash.jobs SET revoked_at = now(), revoke_reason = 'stop it' WHERE id = $1`, id)
			}
			if err != nil {
				t.Fatalf("revocation beside the fenced transaction: %v", err)
			}
			if d := time.Since(sent); d > 3*time.Second { // blocked, it would wait out its 5 s
				t.Fatalf("the revocation took %s", d)
			}
			select {
			case c := <-h.causes:
				if !errors.Is(c, lease.ErrRevoked) {
					t.Fatalf("cause %v", c)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the handler was not told of the revocation")
			}
			if err := <-h.commits; err == nil || !strings.Contains(err.Error(), "LR001") {
				t.Fatalf("commit after the revocation: %v", err)
			}
			b.events.wait(t, 1, 10*time.Second)
			if r := getRow(t, db, id); r.State != "cancelled" || !r.Revoked || h.effects(t, id) != 0 {
				t.Fatalf("row %+v, %d effects", r, h.effects(t, id))
			}
		})
	}
}

// A revocation whose notification never comes (here its triggers are off for the revoking
// session, so none is sent) still reaches a handler inside its fenced transaction: the next
// heartbeat finds it in the row, and the transaction cannot commit.
func TestRevocationWithoutNotificationReachesFencedTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	h := newStubbornFenced(t, db)
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 2*time.Second, 200*time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{"fenced": h})
	id := insert(t, db, "fenced", nil, nil)
	start(t, p)
	<-h.started
	ctx := context.Background()
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	tx, err := db.Begin(rctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var ok bool
	if _, err := tx.Exec(rctx, `SET LOCAL session_replication_role = replica`); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(rctx, `SELECT leash.revoke_job($1, 'quietly')`, id).Scan(&ok); err != nil || !ok {
		t.Fatalf("revoke: %v %v", ok, err)
	}
	if err := tx.Commit(rctx); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-h.causes:
		if !errors.Is(c, lease.ErrRevoked) {
			t.Fatalf("cause %v", c)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler was not told of the revocation")
	}
	if err := <-h.commits; err == nil || !strings.Contains(err.Error(), "LR001") {
		t.Fatalf("commit after the revocation: %v", err)
	}
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, db, id); r.State != "cancelled" || !r.Revoked || h.effects(t, id) != 0 {
		t.Fatalf("row %+v, %d effects", r, h.effects(t, id))
	}
	if p.Stats().Lease.RevokedByRenewal+p.Stats().Lease.RevokedByRecheck != 1 || p.Stats().RevokedByNotification != 0 {
		t.Fatalf("revocation not found by the heartbeat: renewal %d, recheck %d, notification %d", p.Stats().Lease.RevokedByRenewal, p.Stats().Lease.RevokedByRecheck, p.Stats().RevokedByNotification)
	}
}
