package pool_test

// The queue row gate at the pool level: an operator's open transaction, missing rights, a held
// row, a truncated table and a pause under load.

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// An operator pauses a queue the worker is about to serve, in a transaction left open in psql
// (BEGIN; SELECT leash.pause_queue('newq');), while the queue has no row yet (a queue just added
// to WORKER_QUEUES): the pause inserts it. Such a transaction holds that queue, and only that
// queue: the worker's other queue drains. (The rows were first created in one statement, on the
// claim path, which waited up to 10 s for that insert at every refresh.)
func TestOpenPauseOfNewQueueHoldsOnlyThatQueue(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	op, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer op.Rollback(ctx)
	if _, err := op.Exec(ctx, `SELECT leash.pause_queue('newq')`); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "bulk", "bulk", 50)
	cfg := fastConfig()
	cfg.Queues = []string{"bulk", "newq"}
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"bulk": holding(&c, 0)})
	began := time.Now()
	start(t, p)
	deadline := time.Now().Add(30 * time.Second)
	for count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'bulk' AND state = 'completed'`) < 50 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(began)
	// Held by the open insert, each refresh of the queue rows waited 10 s.
	if took > 8*time.Second {
		n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE queue = 'bulk' AND state = 'completed'`)
		t.Fatalf("%d of the 50 jobs of queue bulk completed in %s while another transaction held a not yet committed row of queue newq", n, took.Round(time.Millisecond))
	}
}

// A worker's role needs SELECT, INSERT and UPDATE on leash.queues (claims lock its rows FOR
// SHARE, which takes UPDATE) and SELECT on the change hint: pool.Run refuses to start without
// them, naming the grant, rather than run and never claim a job.
func TestRunRefusesWithoutRightsOnQueues(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	role := fmt.Sprintf("worker_noupd_%d", time.Now().UnixNano()%1e9)
	for _, sql := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA leash TO " + role,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA leash TO " + role,
		"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA leash TO " + role,
		"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA leash TO " + role,
		"REVOKE UPDATE ON leash.queues FROM " + role,
	} {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	t.Cleanup(func() {
		db.Exec(ctx, "DROP OWNED BY "+role)
		db.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	cfg := db.Config().Copy()
	cfg.ConnConfig.User = role
	wdb, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wdb.Close)
	insertMany(t, db, "default", "w", 1)
	pc := fastConfig()
	var c concurrency
	p, _ := setup(t, wdb, pc, map[string]pool.Handler{"w": holding(&c, 0)})
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		p.Shutdown(sctx)
		<-done
	}()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case err := <-done:
			done <- err
			if err == nil || !strings.Contains(err.Error(), "INSERT, UPDATE ON leash.queues") {
				t.Fatalf("Run = %v; want a refusal naming the grant", err)
			}
			return
		case <-deadline:
			var state string
			if err := db.QueryRow(ctx, `SELECT state FROM leash.jobs`).Scan(&state); err != nil {
				t.Fatal(err)
			}
			t.Fatalf("a pool whose role lacks UPDATE on leash.queues started (Run did not refuse) and its job is still %q after 5 s", state)
		case <-time.After(20 * time.Millisecond):
			if count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 1 {
				t.Fatal("a pool whose role lacks UPDATE on leash.queues ran a job: it cannot lock the queue's row")
			}
		}
	}
}

// countingHandler counts log records whose message is msg.
type countingHandler struct {
	msg string
	n   *atomic.Int64
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.n.Add(1)
	}
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// A capped queue whose row stays held (a forgotten SELECT ... FOR UPDATE) does not make its worker
// spin: the busy claims back off to the poll interval. Counts the capped claims over 3 s.
func TestHeldCappedRowDoesNotSpin(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunning(ctx, db, "capq", 2); err != nil {
		t.Fatal(err)
	}
	insertMany(t, db, "capq", "w", 5)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM leash.queues WHERE name = 'capq' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	var n atomic.Int64
	cfg := fastConfig()
	cfg.Queues = []string{"capq"}
	cfg.PollInterval = 500 * time.Millisecond
	cfg.Logger = slog.New(countingHandler{msg: "claiming jobs of a capped queue failed", n: &n})
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"w": holding(&c, 0)})
	start(t, p)
	time.Sleep(3 * time.Second) // the measurement window
	got := n.Load()
	t.Logf("%d busy capped claims in 3 s with PollInterval %s", got, cfg.PollInterval)
	if got > 30 {
		t.Fatalf("%d busy capped claims in 3 s: the worker spins on a held row", got)
	}
}

// A queue without a row is active and uncapped. TRUNCATE leash.queues (resetting every queue to
// that, from any SQL client with the privilege) fires no row trigger; it notifies queue_changed
// with '*', so workers create their rows again at once rather than at their next poll (until
// then they claimed nothing of any queue), as after a DELETE.
func TestTruncatedQueuesRecoverAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.Queues = []string{"a"}
	cfg.PollInterval = 10 * time.Second
	cfg.Engine.WaitAfter = time.Millisecond
	var c concurrency
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"w": holding(&c, 0)})
	start(t, p)
	insertMany(t, db, "a", "w", 1)
	waitFor(t, 15*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 1
	})
	for _, reset := range []string{`DELETE FROM leash.queues`, `TRUNCATE leash.queues`} {
		if _, err := db.Exec(ctx, reset); err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		insertMany(t, db, "a", "w", 1)
		for count(t, db, `SELECT count(*) FROM leash.jobs WHERE state <> 'completed'`) > 0 && time.Since(began) < 20*time.Second {
			time.Sleep(5 * time.Millisecond)
		}
		took := time.Since(began)
		t.Logf("%s: the next job completed %s later", reset, took.Round(time.Millisecond))
		// Without the queue_changed notification it would wait for the poll, 10 s.
		if took > 4*time.Second {
			t.Errorf("after %s, a job of an active, uncapped queue waited %s", reset, took.Round(time.Millisecond))
		}
	}
}

// The emergency brake under load: pools drain a busy uncapped queue of short jobs, and an
// operator pauses it (and resumes, several times). Every claim share-locks the queue's row, and
// the pause waits only for the claims holding it (a few milliseconds).
func TestPauseUnderLoadCommitsAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	insertMany(t, db, "hot", "w", 200000)
	var c concurrency
	for range 12 {
		cfg := fastConfig()
		cfg.Queues = []string{"hot"}
		cfg.Concurrency = 8
		cfg.Engine.OutcomesWithClaims = true
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"w": holding(&c, 0)})
		start(t, p)
	}
	var worst time.Duration
	for i := range 5 {
		waitFor(t, 20*time.Second, func() bool {
			return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'running'`) > 20
		})
		began := time.Now()
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := pool.PauseQueue(pctx, db, "hot")
		cancel()
		took := time.Since(began)
		worst = max(worst, took)
		t.Logf("pause %d: %v after %s", i, err, took.Round(time.Millisecond))
		if err != nil {
			t.Fatalf("PauseQueue of a busy queue: %v after %s", err, took.Round(time.Millisecond))
		}
		if _, err := pool.ResumeQueue(ctx, db, "hot"); err != nil {
			t.Fatal(err)
		}
	}
	if worst > 2*time.Second {
		t.Fatalf("PauseQueue of a busy queue took up to %s", worst.Round(time.Millisecond))
	}
}
