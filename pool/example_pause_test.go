package pool_test

import (
	"context"
	"fmt"

	"github.com/leashq/leash/pool"
)

// ReportArgs are the arguments of a report job, run in queue "reports".
type ReportArgs struct {
	Name string `json:"name"`
}

// Kind names the job kind of ReportArgs.
func (ReportArgs) Kind() string { return "report" }

// Example_pauseQueue pauses a queue: a job inserted into it does not run, while the pool's
// other queue goes on, until the queue is resumed.
func Example_pauseQueue() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()

	// snippet:start pause-queue
	// Durable and for every worker: no job of the queue starts until ResumeQueue (running
	// ones go on). From SQL: SELECT leash.pause_queue('reports').
	if _, err := pool.PauseQueue(ctx, db, "reports"); err != nil {
		panic(err)
	}
	// snippet:end pause-queue

	finished := make(chan pool.JobEvent, 16)
	p, err := pool.New(db, pool.Config{
		Queues: []string{"reports", pool.QueueDefault},
		Observer: observerFunc(func(ev pool.JobEvent) {
			select {
			case finished <- ev:
			default:
			}
		}),
	})
	if err != nil {
		panic(err)
	}
	if err := pool.AddWorker(p, func(ctx context.Context, job *pool.Job, a ReportArgs) error { return nil }); err != nil {
		panic(err)
	}
	if err := pool.AddWorker(p, func(ctx context.Context, job *pool.Job, a EmailArgs) error { return nil }); err != nil {
		panic(err)
	}
	// The report is inserted first: a claim that ignored the pause would take it no later than
	// the email, since one claim takes the jobs of every active queue in (priority, run_at, id)
	// order.
	report, err := pool.InsertArgs(ctx, db, ReportArgs{Name: "monthly"}, &pool.InsertOpts{Queue: "reports"})
	if err != nil {
		panic(err)
	}
	if _, err := pool.InsertArgs(ctx, db, EmailArgs{To: "ada@example.com"}, nil); err != nil {
		panic(err)
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- p.Run(runCtx) }()
	ev := <-finished
	row, err := pool.GetJob(ctx, db, report)
	if err != nil {
		panic(err)
	}
	fmt.Println(ev.Kind, ev.State, "| report:", row.State, "| paused:", p.QueuesPaused()["reports"])

	// snippet:start resume-queue
	if _, err := pool.ResumeQueue(ctx, db, "reports"); err != nil { // workers claim from it at once
		panic(err)
	}
	// snippet:end resume-queue
	ev = <-finished
	fmt.Println(ev.Kind, ev.State, "| queue:", ev.Queue)
	stop()
	if err := <-ran; err != nil {
		panic(err)
	}
	// Output:
	// email completed | report: available | paused: true
	// report completed | queue: reports
}
