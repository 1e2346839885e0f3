package pool_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/pool"
	"github.com/leashq/leash/pool/pooltest"
)

// WelcomeArgs are the arguments of a "welcome" job: the type names its kind, so the handler
// registered for it and every insert of it agree.
type WelcomeArgs struct {
	User string `json:"user"`
}

// Kind names the job kind of WelcomeArgs.
func (WelcomeArgs) Kind() string { return "welcome" }

// Example_typedArgs registers a handler for a typed job, inserts one, and tests the handler on
// a real job without starting a pool (package pooltest).
func Example_typedArgs() {
	ctx := context.Background()
	db, done := exampleDB() // a migrated database (pool.Migrate)
	defer done()
	if _, err := db.Exec(ctx, `CREATE TABLE welcomed (name text)`); err != nil {
		panic(err)
	}

	// The handler writes its effect and the job's completion in one transaction, under the lease.
	welcome := func(ctx context.Context, job *pool.Job, a WelcomeArgs) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := job.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO welcomed VALUES ($1)`, a.User); err != nil {
				return err
			}
			return job.CompleteTx(ctx, tx)
		})
	}

	// In the application: register it for WelcomeArgs' kind, and insert WelcomeArgs.
	finished := make(chan pool.JobEvent, 1)
	p, err := pool.New(db, pool.Config{Observer: observerFunc(func(ev pool.JobEvent) { finished <- ev })})
	if err != nil {
		panic(err)
	}
	if err := pool.AddWorker(p, welcome); err != nil {
		panic(err)
	}
	if _, err := pool.InsertArgs(ctx, db, WelcomeArgs{User: "ada"}, nil); err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error)
	go func() { ran <- p.Run(runCtx) }()
	ev := <-finished
	stop()
	if err := <-ran; err != nil {
		panic(err)
	}
	fmt.Println("pool:", ev.Kind, ev.State)

	// In a test: run the handler on one real job (a row and a lease token), no pool needed.
	res, err := pooltest.Work(ctx, db, WelcomeArgs{User: "grace"}, nil, welcome)
	if err != nil {
		panic(err)
	}
	fmt.Println("pooltest:", res.Job.Kind, res.State, res.Err)

	var names []string
	rows, _ := db.Query(ctx, `SELECT name FROM welcomed ORDER BY name`)
	names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		panic(err)
	}
	fmt.Println("welcomed:", names)
	// Output:
	// pool: welcome completed
	// pooltest: welcome completed <nil>
	// welcomed: [ada grace]
}

// observerFunc adapts a function to pool.Observer.
type observerFunc func(pool.JobEvent)

func (f observerFunc) JobFinished(ev pool.JobEvent) { f(ev) }
