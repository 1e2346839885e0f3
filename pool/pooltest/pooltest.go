// Package pooltest runs a handler on a real *pool.Job without starting a Pool, for an
// application's own tests, and gives each test a database of its own:
//
//	db := pooltest.Database(t) // a fresh database with leash's schema
//	res, err := pooltest.Work(ctx, db, EmailArgs{To: "a@example.com"}, nil, sendEmail(db))
//	// res.Err is what the handler returned, res.State the job's state afterwards.
//
// Without a database (db nil) nothing is stored: the job's lease holds while the handler runs,
// EnsureActive returns nil, and Fence, CompleteTx and SetProgress fail with pool.ErrFenced; a
// handler that uses a database of its own (pgx.BeginFunc on a nil pool) needs one. With a
// database (Database, or any *pgxpool.Pool on a database migrated with pool.Migrate), the job is
// inserted and claimed, so it has a row and a lease token: Fence, CompleteTx, SetProgress and
// SetOutput work as under a Pool, the lease is renewed while the handler runs (a revocation
// reaches it at the next renewal), and the attempt's outcome is written fenced, as a Pool writes
// it. The job's row stays in the database.
package pooltest

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/testwork"
	"github.com/leashq/leash/pool"
)

// Result is what one attempt came to.
type Result struct {
	// Job is the attempt the handler ran.
	Job *pool.Job
	// Err is what the handler returned; a panic is a *pool.PanicError.
	Err error
	// State is the job's state afterwards (pool.StateCompleted, ...): with a database, its
	// row's; without, the state a Pool would write for this ending, "" when it would write
	// nothing (the lease was lost).
	State string
}

// Work runs fn on one attempt of a job of A's kind (pool.KindOf, as pool.AddWorker names it)
// with args as its payload: args is marshalled to JSON and decoded as pool.AddWorker decodes it,
// so fn sees what a worker would see (a field that does not survive JSON, unexported or tagged
// `json:"-"`, arrives as its zero value). db may be nil (see the package comment). opts are the
// job's insert options (nil: the defaults). The error is about the helper (the job could not be
// inserted, claimed or settled, or A names no kind); the handler's own is in Result.Err.
func Work[A pool.JobArgs](ctx context.Context, db *pgxpool.Pool, args A, opts *pool.InsertOpts,
	fn func(ctx context.Context, job *pool.Job, args A) error) (Result, error) {
	if fn == nil {
		return Result{}, errors.New("pooltest: Work needs a function")
	}
	kind, err := pool.KindOf[A]()
	if err != nil {
		return Result{}, fmt.Errorf("pooltest: %w", err)
	}
	return WorkHandler(ctx, db, kind, args, opts, pool.Args(fn))
}

// WorkHandler runs h on one attempt of a job of kind with payload (any value that marshals to
// JSON, as for pool.Insert), like Work: for handlers registered by string kind.
func WorkHandler(ctx context.Context, db *pgxpool.Pool, kind string, payload any, opts *pool.InsertOpts,
	h pool.Handler) (Result, error) {
	run := testwork.Work.(func(context.Context, pool.DB, string, any, *pool.InsertOpts, pool.Handler) (*pool.Job, string, error, error))
	var d pool.DB
	if db != nil {
		d = db
	}
	j, state, herr, err := run(ctx, d, kind, payload, opts, h)
	return Result{Job: j, Err: herr, State: state}, err
}
