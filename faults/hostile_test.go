package faults_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A role without grants holds every advisory lock an earlier release waited for (a capped
// queue's claim key, the waiting hint's, the statistics refresh's) for the whole scenario, and
// other SQL clients write rows at the edges of what the table accepts (an attempt counter one
// claim short of overflowing, a run_at of -infinity, a timeout mixing years and days, a forged
// running row whose lease never ends), while two worker processes drain a capped queue of fenced
// jobs. Nothing stalls: every job, hostile or not, ends within the drain bound, the forged lease
// is taken back, and the invariants hold.
func TestHostileRowsAndStranger(t *testing.T) {
	h := newHarness(t, false)
	ctx := context.Background()
	role := fmt.Sprintf("stranger_%d", time.Now().UnixNano()%1e9)
	for _, sql := range []string{"CREATE ROLE " + role + " NOLOGIN", "GRANT USAGE ON SCHEMA leash TO " + role} {
		if _, err := h.db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	t.Cleanup(func() { h.db.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	stranger, err := pgx.ConnectConfig(ctx, h.db.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close(ctx)
	if _, err := stranger.Exec(ctx, "SET ROLE "+role); err != nil {
		t.Fatal(err)
	}
	if _, err := stranger.Exec(ctx, `SELECT pg_advisory_lock(1818583411, hashtext('default')),
		pg_advisory_lock(30510766707210100), pg_advisory_lock(30510766707204462)`); err != nil {
		t.Fatal(err)
	}
	if _, err := stranger.Exec(ctx, `SELECT FROM leash.queues FOR SHARE`); err == nil {
		t.Fatal("a role without grants locked leash.queues")
	}
	if _, err := h.db.Exec(ctx, `INSERT INTO leash.queues (name, max_running) VALUES ('default', 8)`); err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{
		`INSERT INTO leash.jobs (kind, payload, attempt, max_attempts) VALUES ('ledger', '{"ms": 5}', 2147483646, 2147483647)`,
		`INSERT INTO leash.jobs (kind, payload, run_at) VALUES ('ledger', '{"ms": 5}', '-infinity')`,
		`INSERT INTO leash.jobs (kind, payload, timeout) VALUES ('ledger', '{"ms": 5}', '-1 year 361 days')`,
		`INSERT INTO leash.jobs (kind, payload, state, attempt, lease_token, leased_by, lease_expires_at, heartbeat_at, attempted_at)
		 VALUES ('ledger', '{"ms": 5}', 'running', 1, nextval('leash.lease_tokens'), 'ghost', 'infinity', now(), now())`,
	} {
		if _, err := h.db.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	h.start("A", 10)
	h.start("B", 10)
	h.enqueue(300, "ledger", ledgerArgs{MS: 20}, 20)
	d := h.drain(drainBound(300 * 20 * time.Millisecond / 8))
	h.check(checkOpts{})
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE state <> 'completed'`); n != 0 {
		t.Errorf("%d jobs not completed", n)
	}
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE leased_by IS NULL AND errors::text LIKE '%ghost%'`); n != 1 {
		t.Errorf("the forged lease was taken back %d times; want once", n)
	}
	t.Logf("drained %s beside the stranger's locks and the hostile rows; %s", d.Round(time.Millisecond), h.stats())
}
