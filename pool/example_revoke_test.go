package pool_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// ExportArgs are the arguments of a long-running export job.
type ExportArgs struct {
	Table string `json:"table"`
}

// Kind names the job kind of ExportArgs.
func (ExportArgs) Kind() string { return "export" }

// Example_revokeFromSQL revokes a running job from SQL: the handler's context is cancelled
// with lease.ErrRevoked, the handler returns, and the job ends cancelled with the reason.
func Example_revokeFromSQL() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()

	started := make(chan int64, 1)
	causes := make(chan error, 1)
	// The heartbeat is a backstop: a revocation whose notification a worker missed (here: one
	// sent before its listener connected) reaches the job at the next renewal.
	p, err := pool.New(db, pool.Config{HeartbeatInterval: time.Second})
	if err != nil {
		panic(err)
	}
	// snippet:start revoke-handler
	err = pool.AddWorker(p, func(ctx context.Context, job *pool.Job, a ExportArgs) error {
		started <- job.ID
		// The long work; pool.Sleep returns context.Cause(ctx) as soon as ctx is cancelled.
		err := pool.Sleep(ctx, time.Hour)
		if errors.Is(context.Cause(ctx), lease.ErrRevoked) {
			// An operator revoked the job: stop, and leave nothing half done.
			causes <- context.Cause(ctx)
		}
		return err
	})
	// snippet:end revoke-handler
	if err != nil {
		panic(err)
	}
	if _, err := pool.InsertArgs(ctx, db, ExportArgs{Table: "invoices"}, nil); err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- p.Run(runCtx) }()

	id := <-started
	// snippet:start revoke-sql
	// From any SQL client (psql, another service): durable, and the worker holding the job is
	// told on channel job_revoked at once. (A bare `NOTIFY job_revoked, '42'` also stops job 42
	// on the worker holding it, and records it cancelled, but only if that worker is listening.)
	if _, err := db.Exec(ctx, `SELECT leash.revoke_job($1, 'wrong customer')`, id); err != nil {
		panic(err)
	}
	// snippet:end revoke-sql
	cause := <-causes
	stop()
	if err := <-ran; err != nil { // every outcome is written when Run returns
		panic(err)
	}

	row, err := pool.GetJob(ctx, db, id)
	if err != nil {
		panic(err)
	}
	fmt.Println("cause is lease.ErrRevoked:", errors.Is(cause, lease.ErrRevoked))
	fmt.Println("state:", row.State)
	fmt.Println("reason:", row.RevokeReason)
	// Output:
	// cause is lease.ErrRevoked: true
	// state: cancelled
	// reason: wrong customer
}
