package pool_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// EmailArgs is a typed payload.
type EmailArgs struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
}

// Example embeds a worker pool in an application: migrate, register a typed handler whose
// database writes are fenced by the claim's token, enqueue, and run until a signal.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	db, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	if _, err := pool.Migrate(ctx, db); err != nil {
		panic(err)
	}

	p, err := pool.New(db, pool.Config{Concurrency: 50, Logger: slog.Default()})
	if err != nil {
		panic(err)
	}
	err = p.Register("email", pool.Args(func(ctx context.Context, job *pool.Job, a EmailArgs) error {
		// External side effects: check the lease first (it may have been revoked or lost).
		if err := job.EnsureActive(); err != nil {
			return err
		}
		// Effects in this database: commit them together with the completion, under the lease.
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := job.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "INSERT INTO sent_emails (job_id, recipient) VALUES ($1, $2)", job.ID, a.To); err != nil {
				return err
			}
			return job.CompleteTx(ctx, tx)
		})
	}))
	if err != nil {
		panic(err)
	}

	if _, err := pool.Insert(ctx, db, "email", EmailArgs{To: "ada@example.com", Subject: "hi"}, &pool.InsertOpts{MaxAttempts: 5}); err != nil {
		panic(err)
	}
	// Run returns after ctx is cancelled and running jobs had Config.ShutdownTimeout to finish.
	if err := p.Run(ctx); err != nil {
		panic(err)
	}
}
