package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The minimal queue: what PostgreSQL must do for a job queue at the least, with nothing of
// leash's. A table with the columns a queue needs, one partial index that claims read and one
// for running rows (what a rescue of expired locks would read), and two clients, each claiming
// 100 rows FOR UPDATE SKIP LOCKED in one statement and completing them in a second, both
// autocommitted (durable when the cluster runs with fsync on, as the bench's does). It fences
// nothing, renews nothing, records no errors or attempts' history, and notifies nobody: it is
// the floor leash's burn-down is measured against.
const minimalSchemaSQL = `
	CREATE SCHEMA minq;
	CREATE TABLE minq.jobs (
		id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		queue       text        NOT NULL DEFAULT 'default',
		kind        text        NOT NULL,
		payload     jsonb       NOT NULL DEFAULT '{}',
		state       text        NOT NULL DEFAULT 'available',
		priority    smallint    NOT NULL DEFAULT 0,
		run_at      timestamptz NOT NULL DEFAULT now(),
		attempt     integer     NOT NULL DEFAULT 0,
		locked_by   text,
		locked_at   timestamptz,
		finished_at timestamptz
	);
	CREATE INDEX jobs_claim_idx ON minq.jobs (queue, priority, run_at, id) WHERE state = 'available';
	CREATE INDEX jobs_running_idx ON minq.jobs (locked_at) WHERE state = 'running';`

const minimalClaimSQL = `
	UPDATE minq.jobs j SET state = 'running', attempt = j.attempt + 1, locked_by = $1, locked_at = now()
	FROM (SELECT id FROM minq.jobs
	      WHERE state = 'available' AND queue = 'default' AND run_at <= now()
	      ORDER BY priority, run_at, id
	      LIMIT 100
	      FOR UPDATE SKIP LOCKED) c
	WHERE j.id = c.id
	RETURNING j.id`

const minimalCompleteSQL = `
	UPDATE minq.jobs SET state = 'completed', finished_at = now(), locked_by = NULL, locked_at = NULL
	WHERE id = ANY($1::bigint[]) AND state = 'running' AND locked_by = $2`

// minimalQueue inserts n no-op jobs into the minimal queue on a fresh database and returns the
// rate at which two clients burn them down.
func (b *bench) minimalQueue(ctx context.Context, n int) float64 {
	db := b.minimalDB(ctx, n)
	defer db.Close()
	return float64(n) / minimalDrain(ctx, db, n, 2).Seconds()
}

// minimalQueueConcurrent is minimalQueue with the jobs run on 100 runner goroutines.
func (b *bench) minimalQueueConcurrent(ctx context.Context, n int) float64 {
	db := b.minimalDB(ctx, n)
	defer db.Close()
	return float64(n) / minimalConcurrentDrain(ctx, db, n, 2, 100).Seconds()
}

// minimalDB is a fresh database holding the minimal queue with n no-op jobs, vacuumed and
// analyzed, and a pool of connections to it.
func (b *bench) minimalDB(ctx context.Context, n int) *pgxpool.Pool {
	db := open(ctx, b.freshDB(ctx), 4)
	for _, q := range []string{minimalSchemaSQL, `INSERT INTO minq.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)`, `VACUUM ANALYZE minq.jobs`} {
		var args []any
		if strings.Contains(q, "$1") {
			args = []any{n}
		}
		if _, err := db.Exec(ctx, q, args...); err != nil {
			fail(fmt.Errorf("minimal queue: %w", err))
		}
	}
	return db
}

// minimalDrain runs clients claim-and-complete loops until n jobs are completed.
func minimalDrain(ctx context.Context, db *pgxpool.Pool, n, clients int) time.Duration {
	return minimalClients(ctx, db, n, clients, minimal, nil)
}

// minimalClients runs clients claim-and-complete loops until n jobs are completed and returns
// how long they took. newRun, when not nil, gives each client the function that runs its
// claim's jobs and returns their ids to complete; without it a claim's jobs are completed as
// claimed.
func minimalClients(ctx context.Context, db *pgxpool.Pool, n, clients int, system string, newRun func() func(ids []int64) []int64) time.Duration {
	var done atomic.Int64
	var wg sync.WaitGroup
	began := time.Now()
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			worker := fmt.Sprintf("minimal-%d", c)
			var run func([]int64) []int64
			if newRun != nil {
				run = newRun()
			}
			for done.Load() < int64(n) {
				rows, err := db.Query(ctx, minimalClaimSQL, worker)
				if err != nil {
					fail(fmt.Errorf("%s: claim: %w", system, err))
				}
				var ids []int64
				for rows.Next() {
					var id int64
					rows.Scan(&id)
					ids = append(ids, id)
				}
				if err := rows.Err(); err != nil {
					fail(fmt.Errorf("%s: claim: %w", system, err))
				}
				if len(ids) == 0 {
					if time.Since(began) > time.Minute {
						fail(fmt.Errorf("%s: nothing claimed after %s with %d of %d done", system, time.Since(began), done.Load(), n))
					}
					time.Sleep(time.Millisecond) // the other client holds the last rows
					continue
				}
				if run != nil {
					ids = run(ids)
				}
				tag, err := db.Exec(ctx, minimalCompleteSQL, ids, worker)
				if err != nil {
					fail(fmt.Errorf("%s: complete: %w", system, err))
				}
				done.Add(tag.RowsAffected())
			}
		}()
	}
	wg.Wait()
	return time.Since(began)
}

// minimalConcurrent is the minimal queue whose jobs are run as a Go queue runs handlers: each on
// one of a bounded number of runner goroutines, under a context of its own that the queue can
// cancel (context.WithCancelCause), its result handed back to the client that claimed it, which
// completes its claim's jobs in one statement once all of them have returned. The SQL, the
// clients and the batches are the minimal queue's: what it adds is the worker's share of
// running handlers concurrently, which any queue that runs them so pays, and nothing else (no
// lease, fence, renewal, history or notification).
const minimalConcurrent = "minimal queue, concurrent handlers"

// minimalRun is one claimed job handed to a runner.
type minimalRun struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	id     int64
	done   chan<- int64
}

// minimalConcurrentDrain is minimalDrain with every claimed job run by one of slots runner
// goroutines.
func minimalConcurrentDrain(ctx context.Context, db *pgxpool.Pool, n, clients, slots int) time.Duration {
	runs := make(chan minimalRun) // unbuffered: a job waits for an idle runner, as for a free slot
	var runners sync.WaitGroup
	for range slots {
		runners.Add(1)
		go func() {
			defer runners.Done()
			for r := range runs {
				err := minimalHandler(r.ctx)
				r.cancel(err) // the attempt is over: its context ends, as a queue ends it
				r.done <- r.id
			}
		}()
	}
	d := minimalClients(ctx, db, n, clients, minimalConcurrent, func() func([]int64) []int64 {
		results := make(chan int64, slots)
		return func(ids []int64) []int64 {
			// results has room for every job of the claim: a runner never waits to hand one back.
			for _, id := range ids {
				jctx, cancel := context.WithCancelCause(ctx)
				runs <- minimalRun{ctx: jctx, cancel: cancel, id: id, done: results}
			}
			finished := make([]int64, 0, len(ids))
			for range ids {
				finished = append(finished, <-results)
			}
			return finished
		}
	})
	close(runs)
	runners.Wait()
	return d
}

// minimalHandler is the no-op handler of minimalConcurrentDrain: it reads its context, as a
// handler does.
func minimalHandler(ctx context.Context) error { return ctx.Err() }
