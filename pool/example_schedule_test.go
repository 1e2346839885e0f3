package pool_test

import (
	"context"
	"fmt"

	"github.com/leashq/leash/pool"
)

// DigestArgs are the arguments of a periodic digest job.
type DigestArgs struct {
	Audience string `json:"audience"`
}

// Kind names the job kind of DigestArgs.
func (DigestArgs) Kind() string { return "digest" }

// CleanupArgs are the (empty) arguments of a periodic cleanup job.
type CleanupArgs struct{}

// Kind names the job kind of CleanupArgs.
func (CleanupArgs) Kind() string { return "cleanup" }

// firstRun returns a handler that reports its first run on ran without ever blocking.
func firstRun[A pool.JobArgs](ran chan<- string) func(ctx context.Context, job *pool.Job, a A) error {
	return func(ctx context.Context, job *pool.Job, a A) error {
		select {
		case ran <- job.Kind:
		default:
		}
		return nil
	}
}

// Example_schedule runs durable schedules: one declared in Config.Schedules (stored in
// leash.schedules when Run starts), one inserted into leash.schedules from SQL. Each fires every
// 200ms; the example waits for the first job of each.
func Example_schedule() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()

	// snippet:start schedule-sql
	// From any SQL client: a row with a name, a spec and a kind fires from its next tick on.
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind)
		VALUES ('cleanup', '@every 200ms', 'cleanup')`); err != nil {
		panic(err)
	}
	// snippet:end schedule-sql

	// snippet:start schedule
	p, err := pool.New(db, pool.Config{Schedules: []pool.Schedule{{
		Name:    "digest",       // added, or updated by name, when Run starts
		Spec:    "@every 200ms", // or cron: "0 9 * * 1", "CRON_TZ=Europe/Berlin 0 9 * * 1", "@daily"
		Kind:    DigestArgs{}.Kind(),
		Payload: DigestArgs{Audience: "subscribers"},
	}}}) // a bad spec fails New
	// snippet:end schedule
	if err != nil {
		panic(err)
	}
	digests, cleanups := make(chan string, 1), make(chan string, 1)
	if err := pool.AddWorker(p, firstRun[DigestArgs](digests)); err != nil {
		panic(err)
	}
	if err := pool.AddWorker(p, firstRun[CleanupArgs](cleanups)); err != nil {
		panic(err)
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- p.Run(runCtx) }()
	fmt.Println("ran:", <-digests)
	fmt.Println("ran:", <-cleanups)
	stop()
	if err := <-ran; err != nil {
		panic(err)
	}

	schedules, err := pool.ListSchedules(ctx, db)
	if err != nil {
		panic(err)
	}
	for _, s := range schedules {
		fmt.Printf("%s %q kind %s, enqueued a job: %v\n", s.Name, s.Spec, s.Kind, s.LastJobID != nil)
	}
	// Output:
	// ran: digest
	// ran: cleanup
	// cleanup "@every 200ms" kind cleanup, enqueued a job: true
	// digest "@every 200ms" kind digest, enqueued a job: true
}
