package pool_test

// snippet:start embed-imports

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// snippet:end embed-imports

// snippet:start embed-args

// EmailArgs names its kind, so its handler and its inserts cannot disagree.
type EmailArgs struct {
	To string `json:"to"`
}

// Kind names the job kind of EmailArgs.
func (EmailArgs) Kind() string { return "email" }

// snippet:end embed-args

// snippet:start embed-handler

// sendEmail is the handler of EmailArgs. Its writes in this database are fenced with the
// claim's token and complete the job in the same transaction, so they commit once or not at
// all. Keep the transaction under READ COMMITTED (the default) and let any error roll it back.
func sendEmail(db *pgxpool.Pool) func(ctx context.Context, job *pool.Job, a EmailArgs) error {
	return func(ctx context.Context, job *pool.Job, a EmailArgs) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := job.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO sent_emails (job_id, recipient) VALUES ($1, $2)`,
				job.ID, a.To); err != nil {
				return fmt.Errorf("record email: %w", err)
			}
			return job.CompleteTx(ctx, tx)
		})
	}
}

// snippet:end embed-handler

// snippet:start embed

// runWorker migrates the schema, registers the handlers, enqueues a job and works jobs until
// ctx is cancelled. Run then stops claiming, gives running jobs Config.ShutdownTimeout to
// finish, hands the rest back (available again, the attempt not counted), writes every outcome,
// and only then returns.
func runWorker(ctx context.Context, db *pgxpool.Pool, observer pool.Observer) error {
	if _, err := pool.Migrate(ctx, db); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	p, err := pool.New(db, pool.Config{Concurrency: 50, Logger: slog.Default(), Observer: observer})
	if err != nil {
		return fmt.Errorf("new pool: %w", err)
	}
	if err := pool.AddWorker(p, sendEmail(db)); err != nil {
		return fmt.Errorf("add worker: %w", err)
	}
	if _, err := pool.InsertArgs(ctx, db, EmailArgs{To: "ada@example.com"}, nil); err != nil {
		return fmt.Errorf("enqueue: %w", err)
	}
	if err := p.Run(ctx); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}

// snippet:end embed

// Example is an application's main running a worker (runWorker, as in Example_embed) until
// Ctrl-C or SIGTERM.
func Example() {
	// snippet:start embed-main
	// Ctrl-C or SIGTERM cancels ctx: the pool stops claiming, gives running jobs
	// ShutdownTimeout to finish, hands the rest back, and only then does Run return.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // from now on a second Ctrl-C ends the process at once (leases then expire)
	}()
	db, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := runWorker(ctx, db, nil); err != nil {
		log.Fatal(err)
	}
	// snippet:end embed-main
}

// Example_embed embeds a worker pool in an application: migrate, register a typed handler,
// enqueue, run until a context is cancelled (in main, by a signal: see Example), and wait for
// Run to return. The job's completion is observed through Config.Observer.
func Example_embed() {
	db, done := exampleDB()
	defer done()
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.DiscardHandler)) // the worker's logs stay out of the test output
	ctx := context.Background()
	if _, err := db.Exec(ctx, `CREATE TABLE sent_emails (job_id bigint PRIMARY KEY, recipient text NOT NULL)`); err != nil {
		panic(err)
	}

	// snippet:start embed-observer
	// The Observer is told of each finished job, on a goroutine of the pool's own; this one
	// hands the event over without waiting (a full channel drops it).
	finished := make(chan pool.JobEvent, 16)
	observer := observerFunc(func(ev pool.JobEvent) {
		select {
		case finished <- ev:
		default:
		}
	})
	// snippet:end embed-observer

	// Here the context is cancelled once the job has finished, where main's signal would.
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- runWorker(runCtx, db, observer) }()
	ev := <-finished
	cancel()
	if err := <-ran; err != nil {
		panic(err)
	}
	fmt.Println("finished:", ev.Kind, ev.State)

	var recipient string
	if err := db.QueryRow(ctx, `SELECT recipient FROM sent_emails`).Scan(&recipient); err != nil {
		panic(err)
	}
	fmt.Println("sent to:", recipient)
	// Output:
	// finished: email completed
	// sent to: ada@example.com
}
