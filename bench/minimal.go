package main

import (
	"context"
	"fmt"
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
	db := open(ctx, b.freshDB(ctx), 4)
	defer db.Close()
	if _, err := db.Exec(ctx, minimalSchemaSQL); err != nil {
		fail(fmt.Errorf("minimal queue: schema: %w", err))
	}
	if _, err := db.Exec(ctx, `INSERT INTO minq.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)`, n); err != nil {
		fail(fmt.Errorf("minimal queue: insert: %w", err))
	}
	if _, err := db.Exec(ctx, `VACUUM ANALYZE minq.jobs`); err != nil {
		fail(fmt.Errorf("minimal queue: analyze: %w", err))
	}
	return float64(n) / minimalDrain(ctx, db, n, 2).Seconds()
}

// minimalDrain runs clients claim-and-complete loops until n jobs are completed.
func minimalDrain(ctx context.Context, db *pgxpool.Pool, n, clients int) time.Duration {
	var done atomic.Int64
	var wg sync.WaitGroup
	began := time.Now()
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			worker := fmt.Sprintf("minimal-%d", c)
			for done.Load() < int64(n) {
				rows, err := db.Query(ctx, minimalClaimSQL, worker)
				if err != nil {
					fail(fmt.Errorf("minimal queue: claim: %w", err))
				}
				var ids []int64
				for rows.Next() {
					var id int64
					rows.Scan(&id)
					ids = append(ids, id)
				}
				if err := rows.Err(); err != nil {
					fail(fmt.Errorf("minimal queue: claim: %w", err))
				}
				if len(ids) == 0 {
					if time.Since(began) > time.Minute {
						fail(fmt.Errorf("minimal queue: nothing claimed after %s with %d of %d done", time.Since(began), done.Load(), n))
					}
					time.Sleep(time.Millisecond) // the other client holds the last rows
					continue
				}
				tag, err := db.Exec(ctx, minimalCompleteSQL, ids, worker)
				if err != nil {
					fail(fmt.Errorf("minimal queue: complete: %w", err))
				}
				done.Add(tag.RowsAffected())
			}
		}()
	}
	wg.Wait()
	return time.Since(began)
}
