package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Savepoints: a check staged and applied at once (SET CONSTRAINTS ALL IMMEDIATE) inside a
// savepoint that is rolled back is staged again: the commit after a revocation still fails.
// And a completion staged in a rolled-back savepoint is not applied, while the outer fence
// still is.
func TestSavepointsKeepTheFence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	t.Run("immediate in a rolled-back savepoint", func(t *testing.T) {
		j := runningJob(t, db, time.Minute)
		tx, _ := fencedTx(t, db, j)
		for _, q := range []string{`SAVEPOINT s`, `SET CONSTRAINTS ALL IMMEDIATE`, `ROLLBACK TO SAVEPOINT s`} {
			if _, err := tx.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if ok, err := store.Revoke(rctx, db, j.ID, "stop"); err != nil || !ok {
			t.Fatalf("revoke: %v %v", ok, err)
		}
		if err := tx.Commit(ctx); sqlState(err) != store.CommitRevokedCode {
			t.Fatalf("commit after revocation: %v", err)
		}
	})
	t.Run("completion in a rolled-back savepoint", func(t *testing.T) {
		j := runningJob(t, db, time.Minute)
		tx, _ := fencedTx(t, db, j)
		tx.Exec(ctx, `SAVEPOINT s`)
		if err := store.CompleteTx(ctx, tx, j.ID, j.Token, nil); err != nil {
			t.Fatal(err)
		}
		tx.Exec(ctx, `ROLLBACK TO SAVEPOINT s`)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if st, _, _ := state(t, db, j.ID); st != "running" || effects(t, db, j.ID) != 1 {
			t.Fatalf("state %s", st)
		}
	})
}

// A fenced transaction's commit that waits in the deferred check for a row lock (a revocation
// still in flight, an operator's open UPDATE of the row) is bounded by the transaction's
// statement_timeout as by its lock_timeout: PostgreSQL stops the statement timer before it runs
// the commit's deferred triggers, so the check sets lock_timeout from it (a minute when neither
// is set).
func TestStatementTimeoutAtFencedCommit(t *testing.T) {
	t.Parallel()
	for _, setting := range []string{"statement_timeout", "lock_timeout"} {
		t.Run(setting, func(t *testing.T) {
			ctx := context.Background()
			db := pgtest.Pool(t)
			j := runningJob(t, db, time.Minute)
			tx, _ := fencedTx(t, db, j)
			if err := store.CompleteTx(ctx, tx, j.ID, j.Token, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `SET LOCAL `+setting+` = '200ms'`); err != nil {
				t.Fatal(err)
			}
			rv, err := db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer rv.Rollback(ctx)
			if _, err := rv.Exec(ctx, `UPDATE leash.jobs SET priority = priority WHERE id = $1`, j.ID); err != nil {
				t.Fatal(err)
			}
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			began := time.Now()
			err = tx.Commit(cctx)
			took := time.Since(began)
			if err == nil || effects(t, db, j.ID) != 0 {
				t.Fatalf("commit: %v, %d effects", err, effects(t, db, j.ID))
			}
			if took > time.Second {
				t.Fatalf("commit waited %s under %s = 200ms: %v (%s)", took, setting, err, sqlState(err))
			}
		})
	}
}

// A fenced transaction whose lease expired (its worker stopped renewing: SIGSTOP, partition of
// the renewal path) still blocks every takeover, and its commit still succeeds, long after the
// lease expired: the commit check looks at the token, not at lease_expires_at.
func TestFencedCommitAfterLeaseExpiry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, 100*time.Millisecond)
	tx, _ := fencedTx(t, db, j)
	if err := store.CompleteTx(ctx, tx, j.ID, j.Token, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		var expired bool
		db.QueryRow(ctx, `SELECT lease_expires_at < now() - interval '200 milliseconds' FROM leash.jobs WHERE id = $1`, j.ID).Scan(&expired)
		return expired
	})
	if got, err := store.Rescue(ctx, db, 10); err != nil || len(got) != 0 {
		t.Fatalf("rescue: %v %v", got, err)
	}
	err := tx.Commit(ctx)
	st, _, _ := state(t, db, j.ID)
	t.Logf("commit past the lease: %v; state %s, %d effects", err, st, effects(t, db, j.ID))
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(errors.New("condition never held"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
