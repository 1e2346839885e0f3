package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// fencedTx opens a transaction on its own connection, fences job j in it and writes one row of
// effects, the business write that must commit only under the fence.
func fencedTx(t *testing.T, db *pgxpool.Pool, j store.ClaimedJob) (pgx.Tx, int32) {
	t.Helper()
	ctx := context.Background()
	if _, err := db.Exec(ctx, `CREATE TABLE IF NOT EXISTS effects (job_id bigint)`); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if err := store.Fence(ctx, tx, j.ID, j.Token); err != nil {
		t.Fatalf("fence: %v", err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, j.ID); err != nil {
		t.Fatal(err)
	}
	var pid int32
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return tx, pid
}

func effects(t *testing.T, db *pgxpool.Pool, id int64) (n int) {
	t.Helper()
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE job_id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// A job inside its own open fenced transaction is renewed as usual (the fence does not hold the
// row against renewals), a checkpoint beside it is written at once, and a revocation neither
// waits for it nor loses to it: revoke_job returns at once and the transaction's commit fails,
// taking its business write with it.
func TestFencedTransactionKeepsLeaseAndYieldsToRevocation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, time.Minute)
	tx, _ := fencedTx(t, db, j)
	if err := store.SetProgressTx(ctx, tx, j.ID, j.Token, []byte(`{"in":"tx"}`)); err != nil {
		t.Fatal(err)
	}

	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	renewed, err := store.Renew(rctx, db, store.RenewParams{IDs: []int64{j.ID}, Tokens: []int64{j.Token}, Lease: time.Minute})
	if err != nil || len(renewed) != 1 || renewed[0] != j.Token {
		t.Fatalf("renewal beside the fenced transaction: %v %v", renewed, err)
	}
	if err := store.SetProgress(rctx, db, j.ID, j.Token, []byte(`{"beside":1}`)); err != nil {
		t.Fatalf("SetProgress beside the fenced transaction: %v", err)
	}

	began := time.Now()
	ok, err := store.Revoke(rctx, db, j.ID, "stop")
	if err != nil || !ok {
		t.Fatalf("revoke beside the fenced transaction: %v %v", ok, err)
	}
	if d := time.Since(began); d > 1500*time.Millisecond { // blocked, it would wait out rctx's 2 s
		t.Fatalf("revoke_job took %s", d)
	}
	if err := tx.Commit(ctx); sqlState(err) != store.CommitRevokedCode {
		t.Fatalf("commit after the revocation: %v, want SQLSTATE %s", err, store.CommitRevokedCode)
	}
	if n := effects(t, db, j.ID); n != 0 {
		t.Fatalf("%d effects committed after the revocation", n)
	}
	var progress string
	var revoked bool
	db.QueryRow(ctx, `SELECT progress::text, revoked_at IS NOT NULL FROM leash.jobs WHERE id = $1`, j.ID).Scan(&progress, &revoked)
	if progress != `{"beside": 1}` || !revoked {
		t.Fatalf("progress %s, revoked %v", progress, revoked)
	}
}

// The documented console path, UPDATE leash.jobs SET revoked_at, does not wait for a fenced
// transaction either, and wins over it the same way.
func TestFencedTransactionYieldsToUpdateOfRevokedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, time.Minute)
	tx, _ := fencedTx(t, db, j)
	if err := store.CompleteTx(ctx, tx, j.ID, j.Token, []byte(`{"done":true}`)); err != nil {
		t.Fatal(err)
	}
	uctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := db.Exec(uctx, `UPDATE leash.jobs SET revoked_at = now(), revoke_reason = 'console' WHERE id = $1`, j.ID); err != nil {
		t.Fatalf("UPDATE of revoked_at beside the fenced transaction: %v", err)
	}
	if err := tx.Commit(ctx); sqlState(err) != store.CommitRevokedCode {
		t.Fatalf("commit after the revocation: %v, want SQLSTATE %s", err, store.CommitRevokedCode)
	}
	if st, _, _ := state(t, db, j.ID); st != "running" || effects(t, db, j.ID) != 0 {
		t.Fatalf("state %s, %d effects", st, effects(t, db, j.ID))
	}
}

// waitBlocked waits until backend pid waits for a lock.
func waitBlocked(t *testing.T, db *pgxpool.Pool, pid int32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		if err := db.QueryRow(context.Background(),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d never waited for a lock", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The serialization the commit check rests on, forced: a revocation still in flight when the
// fenced transaction commits makes the commit wait for it and then fail; a fenced transaction
// whose check has locked the row first makes the revocation wait for its commit, which then
// stands (revoke_job finds the job completed). With CompleteTx (the row is updated at commit)
// and without (the row is only locked at commit).
func TestFencedCommitSerializesWithRevocation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	db := pgtest.Pool(t)
	for _, complete := range []bool{false, true} {
		t.Run(fmt.Sprintf("revocation first, complete=%v", complete), func(t *testing.T) {
			j := runningJob(t, db, time.Minute)
			tx, pid := fencedTx(t, db, j)
			if complete {
				if err := store.CompleteTx(ctx, tx, j.ID, j.Token, nil); err != nil {
					t.Fatal(err)
				}
			}
			rv, err := db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer rv.Rollback(ctx)
			var ok bool
			if err := rv.QueryRow(ctx, `SELECT leash.revoke_job($1, 'in flight')`, j.ID).Scan(&ok); err != nil || !ok {
				t.Fatalf("revoke: %v %v", ok, err)
			}
			committed := make(chan error, 1)
			go func() { committed <- tx.Commit(ctx) }()
			waitBlocked(t, db, pid)
			if err := rv.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-committed; sqlState(err) != store.CommitRevokedCode {
				t.Fatalf("commit: %v, want SQLSTATE %s", err, store.CommitRevokedCode)
			}
			if n := effects(t, db, j.ID); n != 0 {
				t.Fatalf("%d effects", n)
			}
		})
	}
	t.Run("fenced commit first", func(t *testing.T) {
		j := runningJob(t, db, time.Minute)
		tx, _ := fencedTx(t, db, j)
		if err := store.CompleteTx(ctx, tx, j.ID, j.Token, nil); err != nil {
			t.Fatal(err)
		}
		// Apply the staged writes now, as the commit would, and hold the row from here on.
		if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err != nil {
			t.Fatal(err)
		}
		conn, err := db.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		var pid int32
		conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid)
		revoked := make(chan bool, 1)
		go func() {
			var ok bool
			if err := conn.QueryRow(ctx, `SELECT leash.revoke_job($1, 'late')`, j.ID).Scan(&ok); err != nil {
				t.Error(err)
			}
			revoked <- ok
		}()
		waitBlocked(t, db, pid)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if ok := <-revoked; ok {
			t.Fatal("revoke_job returned true for a job whose completion committed first")
		}
		if st, _, _ := state(t, db, j.ID); st != "completed" || effects(t, db, j.ID) != 1 {
			t.Fatalf("state %s, %d effects", st, effects(t, db, j.ID))
		}
	})
}

// A fenced transaction keeps every takeover off its job however long it runs, even once the
// lease in the row has expired (its worker stopped renewing); the moment it ends without
// completing (here its backend dies, as with a crashed worker), a rescuer takes the job back.
func TestFencedTransactionEndsThenTakeover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	j := runningJob(t, db, 200*time.Millisecond)
	tx, pid := fencedTx(t, db, j)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var expired bool
		db.QueryRow(ctx, `SELECT lease_expires_at < now() FROM leash.jobs WHERE id = $1`, j.ID).Scan(&expired)
		if expired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("lease never expired")
		}
		time.Sleep(20 * time.Millisecond)
	}
	got, err := store.Rescue(ctx, db, 10)
	if err != nil || len(got) != 0 {
		t.Fatalf("rescue while the fenced transaction lives: %+v %v", got, err)
	}
	var ok bool
	if err := db.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminate: %v %v", ok, err)
	}
	deadline = time.Now().Add(10 * time.Second)
	for {
		// The backend's end releases its locks before pg_terminate_backend's caller sees it
		// gone; until then the row is still held.
		got, err = store.Rescue(ctx, db, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no takeover after the fenced transaction ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got[0].ID != j.ID || got[0].OldToken != j.Token || got[0].State != "retryable" {
		t.Fatalf("rescued %+v", got[0])
	}
	if tx.Commit(ctx) == nil || effects(t, db, j.ID) != 0 {
		t.Fatal("the dead fenced transaction committed")
	}
}

// A role granted leash.fenced_writes but no right on leash.jobs gains nothing from it: its staged
// rows never commit, and while its transaction holds them open, fences, commits and renewals of
// that very job go on. (A role without that grant may not stage at all.)
func TestFencedWritesGiveNothingToRolesWithoutGrants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	role := fmt.Sprintf("leash_nobody_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	if _, err := db.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s; GRANT USAGE ON SCHEMA leash TO %s`, role, role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		db.Exec(context.Background(), fmt.Sprintf(`REVOKE ALL ON leash.fenced_writes FROM %s; REVOKE ALL ON SCHEMA leash FROM %s; DROP ROLE %s`, role, role, role))
	})
	{
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, "SET LOCAL ROLE "+role+"; INSERT INTO leash.fenced_writes (job_id, token) VALUES (1, 1)")
		tx.Rollback(ctx)
		if err == nil {
			t.Fatal("a role without grants staged a write")
		}
	}
	if _, err := db.Exec(ctx, fmt.Sprintf(`GRANT SELECT, INSERT, DELETE ON leash.fenced_writes TO %s`, role)); err != nil {
		t.Fatal(err)
	}
	j := runningJob(t, db, time.Minute)
	asRole := func() pgx.Tx {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback(context.Background()) })
		if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+role); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO leash.fenced_writes (job_id, token, complete) VALUES ($1, $2, true)`, j.ID, j.Token); err != nil {
			t.Fatalf("stage: %v", err)
		}
		return tx
	}
	if err := asRole().Commit(ctx); err == nil {
		t.Fatal("a role without rights on leash.jobs committed a staged write")
	}
	if _, err := asRole().Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err == nil {
		t.Fatal("a role without rights on leash.jobs applied a staged write")
	}
	open := asRole() // held open beside everything below
	defer open.Rollback(ctx)
	octx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	tx, _ := fencedTx(t, db, j)
	if err := store.CompleteTx(octx, tx, j.ID, j.Token, nil); err != nil {
		t.Fatal(err)
	}
	if renewed, err := store.Renew(octx, db, store.RenewParams{IDs: []int64{j.ID}, Tokens: []int64{j.Token}, Lease: time.Minute}); err != nil || len(renewed) != 1 {
		t.Fatalf("renew: %v %v", renewed, err)
	}
	if err := tx.Commit(octx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	if st, _, _ := state(t, db, j.ID); st != "completed" {
		t.Fatalf("state %s", st)
	}
	var staged int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.fenced_writes`).Scan(&staged)
	if staged != 0 {
		t.Fatalf("%d staged writes left committed", staged)
	}
}
