package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

const (
	ceiling         = "no-trigger ceiling"
	ceilingPrepared = "no-trigger ceiling, with a parameter"
)

// producers: 32 clients inserting one job per transaction for a few seconds, each system with a
// worker working the queue. The ceiling is the same INSERT into leash.jobs with triggers off
// (session_replication_role = replica). The SQL INSERT is measured twice: as literal SQL (the
// simple protocol, as psql and pgbench send it: parsed and planned at every insert) and with a
// parameter (as an application's driver sends it: a prepared statement, like River's inserts and
// pool.Insert), each against its own ceiling.
func (b *bench) producers(ctx context.Context) {
	const clients = 32
	const secs = 8
	scenario := fmt.Sprintf("%d producers, one job per transaction, %ds", clients, secs)
	logf("%s", scenario)
	// hammer runs clients goroutines calling insert until the deadline and returns inserts/s.
	hammer := func(insert func(ctx context.Context) error) float64 {
		var n atomic.Int64
		var wg sync.WaitGroup
		end := time.Now().Add(secs * time.Second)
		began := time.Now()
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					if err := insert(ctx); err != nil {
						fail(err)
					}
					n.Add(1)
				}
			}()
		}
		wg.Wait()
		return float64(n.Load()) / time.Since(began).Seconds()
	}
	producerPool := func(url string, replica bool) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			fail(err)
		}
		cfg.MaxConns = clients
		if replica {
			cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
				_, err := c.Exec(ctx, "SET session_replication_role = replica")
				return err
			}
		}
		db, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			fail(err)
		}
		return db
	}
	const sqlInsert = `INSERT INTO leash.jobs (kind) VALUES ('noop')`
	leashRun := func(replica bool, alwaysWaiting bool, insert func(db *pgxpool.Pool) func(context.Context) error) func() float64 {
		return func() float64 {
			url := b.freshDB(ctx)
			wdb := open(ctx, url, 10)
			defer wdb.Close()
			pdb := producerPool(url, replica)
			defer pdb.Close()
			p := newLeash(wdb, 100, nil, nil)
			go p.Run(ctx)
			defer p.Shutdown(ctx)
			if alwaysWaiting {
				// A registration that never expires: every insert notifies, as before wake-ups on demand.
				if _, err := wdb.Exec(ctx, `INSERT INTO leash.waiters VALUES ('default', 'always', 'infinity')`); err != nil {
					fail(err)
				}
			}
			return hammer(insert(pdb))
		}
	}
	sqlInsertFn := func(db *pgxpool.Pool) func(context.Context) error {
		return func(ctx context.Context) error { _, err := db.Exec(ctx, sqlInsert); return err }
	}
	// pgx prepares a statement that has arguments (and sends one that has none as a simple query).
	const paramInsert = `INSERT INTO leash.jobs (kind) VALUES ($1)`
	paramInsertFn := func(db *pgxpool.Pool) func(context.Context) error {
		return func(ctx context.Context) error { _, err := db.Exec(ctx, paramInsert, "noop"); return err }
	}
	ts := []trial{
		{system: ceiling, higherBetter: true, run: leashRun(true, false, sqlInsertFn)},
		{system: ceilingPrepared, higherBetter: true, run: leashRun(true, false, paramInsertFn)},
	}
	for _, t := range []riverTuning{riverDefaults, riverTuned} {
		ts = append(ts, trial{system: t.String(), baseline: []string{ceiling}, higherBetter: true, run: func() float64 {
			url := b.freshDB(ctx)
			db := open(ctx, url, clients+20)
			defer db.Close()
			c := newRiver(db, 100, t, nil)
			if err := c.Start(ctx); err != nil {
				fail(err)
			}
			defer stopRiver(c)
			return hammer(func(ctx context.Context) error { _, err := c.Insert(ctx, noopArgs{}, nil); return err })
		}})
	}
	vs := []string{ceiling, "River defaults"}
	ts = append(ts,
		trial{system: "leash, SQL INSERT", baseline: vs, higherBetter: true, run: leashRun(false, false, sqlInsertFn)},
		trial{system: "leash, SQL INSERT with a parameter", baseline: []string{ceilingPrepared, "River defaults"}, higherBetter: true,
			run: leashRun(false, false, paramInsertFn)},
		trial{system: "leash, pool.Insert", baseline: []string{ceilingPrepared, "River defaults"}, higherBetter: true, run: leashRun(false, false, func(db *pgxpool.Pool) func(context.Context) error {
			return func(ctx context.Context) error { _, err := pool.Insert(ctx, db, "noop", nil, nil); return err }
		})},
		trial{system: "leash, SQL INSERT, every insert notifying", baseline: vs, higherBetter: true, once: true, run: leashRun(false, true, sqlInsertFn)},
	)
	b.trials(scenario, "inserts/s", "inserts/s", ts)
}
