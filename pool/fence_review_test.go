package pool_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// A revocation by bare NOTIFY (no row change, as typed in psql) of jobs inside their fenced
// transactions: the handler is cancelled with ErrRevoked only once revoked_at is in the row, so
// a handler that commits as its context ends (one that ignores it, or whose commit was already
// on its way) has its commit refused. (Cancelled before the write, 8 to 19 of 20 committed their
// effects and their jobs ended cancelled.)
func TestBareNotifyRevocationFencesTheCommit(t *testing.T) {
	t.Parallel()
	const n = 20
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	h := newStubbornFenced(t, poolOf(t, url, n+4)) // the application's own pool, for its transactions
	cfg := slowHeartbeat()
	cfg.Concurrency = n
	p, b := setup(t, db, cfg, map[string]pool.Handler{"fenced": h})
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = insert(t, db, "fenced", nil, nil)
	}
	start(t, p)
	for range n {
		<-h.started
	}
	waitFor(t, 10*time.Second, p.ListenerConnected)
	for _, id := range ids {
		mustExec(t, db, fmt.Sprintf(`NOTIFY job_revoked, '%d'`, id))
	}
	for range n {
		if c := <-h.causes; !errors.Is(c, lease.ErrRevoked) {
			t.Fatalf("cause %v", c)
		}
	}
	stuck := false
	for i := range n {
		select {
		case <-h.commits:
		case <-time.After(20 * time.Second):
			stuck = true
			t.Errorf("%d of %d fenced commits still not returned after 20s", n-i, n)
			rows, _ := db.Query(context.Background(), `SELECT pid, state, wait_event_type, wait_event, left(query, 60) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`)
			for rows.Next() {
				var pid int32
				var st, wt, we, q *string
				rows.Scan(&pid, &st, &wt, &we, &q)
				t.Logf("backend %d %s %s/%s %s", pid, deref(st), deref(wt), deref(we), deref(q))
			}
			rows.Close()
		}
		if stuck {
			break
		}
	}
	if !stuck {
		b.events.wait(t, n, 20*time.Second)
	}
	committed := 0
	for _, id := range ids {
		r := getRow(t, db, id)
		if e := h.effects(t, id); e != 0 {
			committed++
			t.Logf("job %d: state %s, revoked %v, %d effects committed after the revocation reached its handler", id, r.State, r.Revoked, e)
		}
	}
	if committed > 0 {
		t.Fatalf("%d of %d fenced transactions committed after a bare-NOTIFY revocation reached their handlers", committed, n)
	}
}

// A handler that returns success after its CompleteTx did not commit (here: CompleteTx inside a
// savepoint that is rolled back while the outer transaction with the effect commits; pgx nested
// transactions do this) gets a retry written at once, saying so; the worker never completes a
// job itself after CompleteTx, since it cannot know whether the effects committed. (Before, no
// outcome was written and the job sat running until its lease expired.)
func TestCompleteTxRolledBackThenSuccess(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	mustExec(t, db, `CREATE TABLE effects (job_id bigint)`)
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.RescueInterval = time.Second, 100*time.Millisecond
	p, b := setup(t, db, cfg, map[string]pool.Handler{"tx": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := j.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
				return err
			}
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := j.CompleteTx(ctx, sp); err != nil {
				return err
			}
			return sp.Rollback(ctx) // changed its mind about completing in the transaction
		})
	})})
	id := insert(t, db, "tx", nil, &pool.InsertOpts{MaxAttempts: 1})
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, db, id); r.State != "failed" || !strings.Contains(deref(r.LastError), "did not commit") {
		t.Fatalf("job %s, last error %v; want failed (its one attempt), saying the completion did not commit", r.State, deref(r.LastError))
	}
}

// A handler whose CompleteTx transaction committed and that then returns an error (a step after
// the commit failed) leaves the job completed; the worker's own outcome, refused by the fence, is
// not counted or logged as a stale write, since the claim never lost its lease.
func TestCompleteTxCommittedThenError(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	p, b := setup(t, db, fastConfig(), map[string]pool.Handler{"tx": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return j.CompleteTx(ctx, tx) }); err != nil {
			return err
		}
		return errors.New("after the commit")
	})})
	id := insert(t, db, "tx", nil, nil)
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, db, id); r.State != "completed" {
		t.Fatalf("job %+v", r)
	}
	if s := p.Stats().StaleWrites; s != 0 {
		t.Fatalf("%d stale writes counted for a claim that never lost its lease", s)
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}
