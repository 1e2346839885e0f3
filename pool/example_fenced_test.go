package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// ChargeArgs are the arguments of a job that debits an account.
type ChargeArgs struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// Kind names the job kind of ChargeArgs.
func (ChargeArgs) Kind() string { return "charge" }

// snippet:start fenced

// charge debits the account in the same transaction that completes the job: Fence first (the
// claim must still hold the job, or nothing commits), then the business write, then CompleteTx.
// The debit and the completion commit together or not at all.
func charge(db *pgxpool.Pool) func(ctx context.Context, job *pool.Job, a ChargeArgs) error {
	return func(ctx context.Context, job *pool.Job, a ChargeArgs) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := job.Fence(ctx, tx); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE accounts SET cents = cents - $2 WHERE name = $1`, a.Account, a.Cents)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "23514" { // CHECK (cents >= 0)
				return pool.Permanent(fmt.Errorf("insufficient funds: %w", err)) // not worth retrying
			}
			if err != nil {
				return fmt.Errorf("debit: %w", err)
			}
			return job.CompleteTx(ctx, tx)
		})
	}
}

// snippet:end fenced

// Example_fenced writes a handler's effect and the job's completion in one transaction, fenced
// by the claim's token: a charge that commits completes its job, and one whose debit fails
// leaves neither the debit nor a completion.
func Example_fenced() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()
	if _, err := db.Exec(ctx, `
		CREATE TABLE accounts (name text PRIMARY KEY, cents bigint NOT NULL CHECK (cents >= 0));
		INSERT INTO accounts VALUES ('ada', 100)`); err != nil {
		panic(err)
	}

	finished := make(chan pool.JobEvent, 16)
	p, err := pool.New(db, pool.Config{Observer: observerFunc(func(ev pool.JobEvent) {
		select {
		case finished <- ev:
		default:
		}
	})})
	if err != nil {
		panic(err)
	}
	if err := pool.AddWorker(p, charge(db)); err != nil {
		panic(err)
	}
	var ids []int64
	for _, cents := range []int64{30, 200} { // the second is more than the account holds
		id, err := pool.InsertArgs(ctx, db, ChargeArgs{Account: "ada", Cents: cents}, nil)
		if err != nil {
			panic(err)
		}
		ids = append(ids, id)
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- p.Run(runCtx) }()
	for range ids {
		<-finished
	}
	stop()
	if err := <-ran; err != nil {
		panic(err)
	}

	for _, id := range ids {
		row, err := pool.GetJob(ctx, db, id)
		if err != nil {
			panic(err)
		}
		var a ChargeArgs
		if err := json.Unmarshal(row.Payload, &a); err != nil {
			panic(err)
		}
		fmt.Printf("charge of %d: %s\n", a.Cents, row.State)
	}
	var cents int64
	if err := db.QueryRow(ctx, `SELECT cents FROM accounts WHERE name = 'ada'`).Scan(&cents); err != nil {
		panic(err)
	}
	fmt.Println("balance:", cents)
	// Output:
	// charge of 30: completed
	// charge of 200: failed
	// balance: 70
}
