package pooltest_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
	"github.com/leashq/leash/pool/pooltest"
)

// SignupArgs are the arguments of a job that welcomes a new user.
type SignupArgs struct {
	Email string `json:"email"`
}

// Kind names the job kind of SignupArgs.
func (SignupArgs) Kind() string { return "signup" }

// welcome is the handler under test: it refuses a bad address for good, and records the
// welcome fenced, in the transaction that completes the job.
func welcome(db *pgxpool.Pool) func(ctx context.Context, job *pool.Job, a SignupArgs) error {
	return func(ctx context.Context, job *pool.Job, a SignupArgs) error {
		if !strings.Contains(a.Email, "@") {
			return pool.Permanent(fmt.Errorf("not an email address: %q", a.Email))
		}
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := job.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO welcomed (email) VALUES ($1)`, a.Email); err != nil {
				return fmt.Errorf("record welcome: %w", err)
			}
			return job.CompleteTx(ctx, tx)
		})
	}
}

// ExampleWork tests a handler on one attempt of a job, without starting a pool: without a
// database for what needs none, and with one for fenced writes and CompleteTx.
func ExampleWork() {
	ctx := context.Background()

	// snippet:start pooltest-nodb
	// Without a database (nil): the handler gets a live job; nothing is stored, and Fence,
	// CompleteTx and SetProgress fail. res.State is what a pool would write.
	res, err := pooltest.Work(ctx, nil, SignupArgs{Email: "nobody"}, nil, welcome(nil))
	if err != nil {
		panic(err) // the helper failed, not the handler
	}
	fmt.Println(res.State, pool.IsPermanent(res.Err), res.Err)
	// snippet:end pooltest-nodb

	db, done := exampleDB() // a database migrated with pool.Migrate
	defer done()
	if _, err := db.Exec(ctx, `CREATE TABLE welcomed (email text PRIMARY KEY)`); err != nil {
		panic(err)
	}
	// snippet:start pooltest-db
	// With a database: the job is inserted and claimed, so it has a row and a lease token;
	// Fence and CompleteTx work as under a pool, and the outcome is written as a pool writes it.
	res, err = pooltest.Work(ctx, db, SignupArgs{Email: "ada@example.com"}, nil, welcome(db))
	if err != nil {
		panic(err)
	}
	row, err := pool.GetJob(ctx, db, res.Job.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(res.State, row.State, res.Err)
	// snippet:end pooltest-db

	var email string
	if err := db.QueryRow(ctx, `SELECT email FROM welcomed`).Scan(&email); err != nil {
		panic(err)
	}
	fmt.Println("welcomed:", email)
	// Output:
	// failed true not an email address: "nobody"
	// completed completed <nil>
	// welcomed: ada@example.com
}
