package store_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// wakeListener LISTENs on job_available and on the wake channels of waiters w0..w(n-1), which
// it registers on queue default with slots free slots each; got returns, per channel, the
// payloads sent before it was called (a sentinel from conn marks the end).
func wakeListener(t *testing.T, url string, db *pgxpool.Pool, n, slots int) (chans []string, got func() map[string][]string) {
	t.Helper()
	ctx := context.Background()
	l, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close(context.Background()) })
	exec(t, l, "LISTEN job_available; LISTEN test_done")
	for i := range n {
		ch := fmt.Sprintf("leash_wake_%016x", i+1)
		chans = append(chans, ch)
		exec(t, l, "LISTEN "+ch)
		if _, err := store.RegisterWaker(ctx, db, fmt.Sprintf("w%d", i), []string{"default"}, time.Hour,
			store.Wake{Channel: ch, Slots: slots, Armed: true}); err != nil {
			t.Fatal(err)
		}
	}
	return chans, func() map[string][]string {
		t.Helper()
		exec(t, db, "NOTIFY test_done")
		out := map[string][]string{}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			m, err := l.WaitForNotification(wctx)
			if err != nil {
				t.Fatalf("waiting for notifications: %v (got %v)", err, out)
			}
			if m.Channel == "test_done" {
				return out
			}
			out[m.Channel] = append(out[m.Channel], m.Payload)
		}
	}
}

// An insert picks one waiter and notifies it alone, on its own channel, with the queue's name;
// the waiter stays picked (another insert picks another waiter) until it re-arms.
func TestInsertPicksOneWaiter(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	chans, got := wakeListener(t, url, db, 4, 1)
	got()
	var picked []string
	for range 4 {
		exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
		g := got()
		if len(g) != 1 || len(g[chans[0]])+len(g[chans[1]])+len(g[chans[2]])+len(g[chans[3]]) != 1 {
			t.Fatalf("one insert sent %v, want one wake on one waiter's channel", g)
		}
		for ch, ps := range g {
			if ps[0] != "default" {
				t.Fatalf("wake payload %q, want the queue's name", ps[0])
			}
			picked = append(picked, ch)
		}
	}
	slices.Sort(picked)
	if !slices.Equal(picked, chans) {
		t.Fatalf("four inserts picked %v, want each waiter once", picked)
	}
	// Every waiter is picked: the one picked last, within the last second, is notified again
	// (it may be claiming already; a wake makes it claim once more).
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g) != 1 {
		t.Fatalf("an insert with every waiter picked just now sent %v, want one wake", g)
	}
	// Picked over a second ago and silent since: taken for gone, never notified again until it
	// re-arms.
	exec(t, db, `UPDATE leash.waiters SET woken_at = woken_at - interval '2 seconds'`)
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g) != 0 {
		t.Fatalf("an insert with every waiter picked long ago sent %v", g)
	}
	if err := store.RearmWaiter(ctx, db, "w2", 1); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g[chans[2]]) != 1 || len(g) != 1 {
		t.Fatalf("after w2 re-armed an insert sent %v, want one wake for w2", g)
	}
	// A refresh of an armed registration re-arms; one not armed (its listener down) does not.
	exec(t, db, `UPDATE leash.waiters SET woken_at = woken_at - interval '2 seconds'`)
	if _, err := store.RegisterWaker(ctx, db, "w9", []string{"default"}, time.Hour, store.Wake{Channel: "leash_wake_00000000000000ff"}); err != nil {
		t.Fatal(err)
	}
	if _, err := store.RegisterWaker(ctx, db, "w1", []string{"default"}, time.Hour, store.Wake{Channel: chans[1], Slots: 1}); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g) != 0 {
		t.Fatalf("a registration that is not armed was picked: %v", g)
	}
	var w9 string
	if err := db.QueryRow(ctx, `SELECT woken_at::text FROM leash.waiters WHERE waiter = 'w9'`).Scan(&w9); err != nil || w9 != "-infinity" {
		t.Fatalf("a new registration that is not armed: woken_at %q (%v), want -infinity (never picked)", w9, err)
	}
	if _, err := store.RegisterWaker(ctx, db, "w1", []string{"default"}, time.Hour, store.Wake{Channel: chans[1], Slots: 1, Armed: true}); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g[chans[1]]) != 1 || len(g) != 1 {
		t.Fatalf("after w1 registered armed an insert sent %v, want one wake for w1", g)
	}
}

// A multi-row insert picks waiters until their free slots cover its runnable rows; rows not
// runnable yet count for nothing.
func TestMultiRowInsertPicksEnoughWaiters(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	chans, got := wakeListener(t, url, db, 6, 3)
	got()
	wokenCount := func() int {
		n := 0
		for _, ps := range got() {
			n += len(ps)
		}
		return n
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, 7)`)
	if n := wokenCount(); n != 3 {
		t.Fatalf("7 rows with 3 free slots per waiter woke %d waiters, want 3", n)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind, run_at) SELECT 'k', now() + interval '1 hour' FROM generate_series(1, 50)`)
	if n := wokenCount(); n != 0 {
		t.Fatalf("rows scheduled for later woke %d waiters", n)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, 1000)`)
	// The three left, and the three picked just now once more.
	if n := wokenCount(); n != len(chans) {
		t.Fatalf("1000 rows woke %d waiters, want all %d", n, len(chans))
	}
	exec(t, db, `UPDATE leash.waiters SET woken_at = woken_at - interval '2 seconds'`)
	exec(t, db, `INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, 10)`)
	if n := wokenCount(); n != 0 {
		t.Fatalf("rows with every waiter picked long ago woke %d", n)
	}
}

// Concurrent inserters never wait for each other on leash.waiters or on the waiting hint's lock:
// an open transaction that picked a waiter leaves it locked, and the next insert picks another
// one at once; an insert completes while a registration holds the hint's lock.
func TestConcurrentInsertsPickDifferentWaiters(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	chans, got := wakeListener(t, url, db, 2, 1)
	got()
	hint, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hint.Rollback(ctx)
	exec(t, hint, `SELECT FROM leash.waiting_hint_lock FOR UPDATE`)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	exec(t, tx, `SET LOCAL statement_timeout = '2s'`)
	if _, err := tx.Exec(ctx, `INSERT INTO leash.jobs (kind) VALUES ('k')`); err != nil {
		t.Fatalf("an insert while a registration holds the hint's lock: %v", err)
	}
	c, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	exec(t, c, `SET statement_timeout = '2s'`)
	defer exec(t, c, `RESET statement_timeout`)
	if _, err := c.Exec(ctx, `INSERT INTO leash.jobs (kind) VALUES ('k')`); err != nil {
		t.Fatalf("an insert beside an open one and a held hint lock: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	g := got()
	if len(g[chans[0]]) != 1 || len(g[chans[1]]) != 1 {
		t.Fatalf("two concurrent inserts sent %v, want one wake for each waiter", g)
	}
}

// A picked waiter's mark is undone with the insert: a rolled-back insert leaves it pickable.
func TestRolledBackInsertLeavesWaiterPickable(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	chans, got := wakeListener(t, url, db, 1, 1)
	got()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	exec(t, tx, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('k')`)
	if g := got(); len(g[chans[0]]) != 1 {
		t.Fatalf("after a rolled-back insert, an insert sent %v, want one wake", g)
	}
}

// While a registration of the previous release's statements (no wake channel) waits on a queue,
// inserts into it notify job_available, which that worker hears, and no wake channel; a
// registration's channel can only be a wake channel.
func TestPreviousReleaseRegistrationGetsJobAvailable(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	_, got := wakeListener(t, url, db, 2, 1)
	if err := store.RegisterWaiter(ctx, db, "old", []string{"default"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	got()
	exec(t, db, `INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, 3)`)
	if g := got(); len(g) != 1 || !slices.Equal(g["job_available"], []string{"default"}) {
		t.Fatalf("with a previous-release waiter an insert sent %v, want job_available default", g)
	}
	for _, ch := range []string{"job_revoked", "queue_changed", "leash_wake_x", "leash_wake_0123456789ABCDEF"} {
		if _, err := store.RegisterWaker(ctx, db, "bad", []string{"default"}, time.Hour, store.Wake{Channel: ch, Armed: true}); err == nil {
			t.Fatalf("a registration with channel %q was accepted", ch)
		}
	}
}

// A role of the README's inserter grants, which has no right on leash.waiters, picks and wakes a
// waiter through the trigger (it runs with its owner's rights).
func TestInserterRolePicksWaiters(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	chans, got := wakeListener(t, url, db, 1, 1)
	got()
	ins := connAsRole(t, db, "leash_inserter", readmeGrants(t, "leash_inserter")...)
	if _, err := ins.Exec(ctx, `INSERT INTO leash.jobs (kind) VALUES ('k')`); err != nil {
		t.Fatal(err)
	}
	if g := got(); len(g[chans[0]]) != 1 {
		t.Fatalf("the inserter's insert sent %v, want one wake", g)
	}
}
