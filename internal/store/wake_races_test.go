package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Two inserts committing at once, one waiter: the first insert's trigger locks the waiter to
// pick it; the second finds it locked (SKIP LOCKED) and, with no other waiter to pick, still
// wakes it, before the first commits. Otherwise the second job would wait for a poll.
func TestConcurrentInsertStillWakesTheLockedWaiter(t *testing.T) {
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
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO leash.jobs (kind) VALUES ('first')`); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `INSERT INTO leash.jobs (kind) VALUES ('second')`) // commits while the first holds the waiter
	if g := got(); len(g[chans[0]]) != 1 || len(g) != 1 {
		t.Fatalf("the insert beside one picking the only waiter sent %v, want one wake to that waiter", g)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if g := got(); len(g[chans[0]]) != 1 {
		t.Fatalf("the first insert sent %v at its commit, want its wake", g)
	}
}

// A waiter's poll claims unless another live waiter of each of its queues claimed for a poll
// within the window; a poll time in the future, an expired waiter or a window of 0 covers
// nothing.
func TestPollsCoveredByOtherWaiters(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	poll := func(waiter string, queues []string, window time.Duration) bool {
		t.Helper()
		claim, err := store.RegisterWaker(ctx, db, waiter, queues, time.Hour,
			store.Wake{Channel: "leash_wake_00000000000000aa", Armed: true, Poll: true, PollWindow: window})
		if err != nil {
			t.Fatal(err)
		}
		return claim
	}
	if !poll("a", []string{"q1"}, time.Minute) {
		t.Fatal("the only waiter's poll did not claim")
	}
	if poll("b", []string{"q1"}, time.Minute) {
		t.Fatal("a poll of q1 just after another waiter's claimed")
	}
	if !poll("b", []string{"q1"}, 0) {
		t.Fatal("a poll with a window of 0 did not claim")
	}
	if !poll("c", []string{"q1", "q2"}, time.Minute) {
		t.Fatal("a poll of q1 and q2 claimed nothing though no one polled q2")
	}
	if poll("d", []string{"q2", "q1"}, time.Minute) {
		t.Fatal("a poll of q1 and q2, both covered, claimed")
	}
	// A refresh that is not a poll keeps the poll time; one that claims records it.
	if _, err := store.RegisterWaker(ctx, db, "c", []string{"q1", "q2"}, time.Hour, store.Wake{Channel: "leash_wake_00000000000000aa"}); err != nil {
		t.Fatal(err)
	}
	var recorded int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.waiters WHERE waiter = 'c' AND polled_at IS NOT NULL`).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded != 2 {
		t.Fatalf("waiter c's poll time kept on %d of its 2 rows", recorded)
	}
	// Forged or stale rows cover nothing.
	exec(t, db, `UPDATE leash.waiters SET polled_at = now() + interval '1 year'`)
	if !poll("e", []string{"q1"}, time.Minute) {
		t.Fatal("poll times in the future covered a poll")
	}
	exec(t, db, `UPDATE leash.waiters SET polled_at = now(), expires_at = now() - interval '1 second' WHERE waiter <> 'f'`)
	if !poll("f", []string{"q1"}, time.Minute) {
		t.Fatal("expired waiters covered a poll")
	}
	exec(t, db, `UPDATE leash.waiters SET polled_at = now() - interval '2 minutes', expires_at = now() + interval '1 hour'`)
	if !poll("g", []string{"q1"}, time.Minute) {
		t.Fatal("polls older than the window covered a poll")
	}
}
