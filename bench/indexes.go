package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// schemaVariant is leash's schema with one change applied after the migrations: what an index,
// a trigger or a storage setting costs the burn-down, measured by taking it away or changing it.
type schemaVariant struct {
	name string
	sql  string // run on the fresh database after the migrations; empty: as migrated
}

// schemaVariants are the candidate cuts of the database work per job (docs/performance.md,
// "What a job writes"). Rows marked "bound" are not shippable as they stand (the guarantees need
// what they take away): they measure what the thing costs at most.
var schemaVariants = []schemaVariant{
	{name: "leash as migrated"},
	{name: "fillfactor 80 (before 022)", sql: `ALTER TABLE leash.jobs SET (fillfactor = 80)`},
	{name: "fillfactor 100", sql: `ALTER TABLE leash.jobs SET (fillfactor = 100)`},
	{name: "fillfactor 50", sql: `ALTER TABLE leash.jobs SET (fillfactor = 50)`},
	{name: "running index on queue alone", sql: `
		CREATE INDEX jobs_running_idx2 ON leash.jobs (queue) WHERE state = 'running';
		DROP INDEX leash.jobs_running_queue_idx`},
	{name: "bound: no finished index", sql: `DROP INDEX leash.jobs_finished_idx`},
	{name: "bound: no BEFORE row triggers", sql: `
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_revoked_stays_stopped;
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_insert;
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_update;
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_unmet;
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_completing;
		ALTER TABLE leash.jobs DISABLE TRIGGER jobs_workflow_retried`},
}

// indexAblation: the burn-down of the minimal queue and of leash with each schema variant,
// interleaved, with the WAL each job's life wrote (insert, claim, outcome) and the server's CPU
// per job while the jobs drained beside the rate.
// -variants picks variants by position (0 is leash as migrated).
func (b *bench) indexAblation(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("schema ablation, burn-down %d, 100 workers", n)
	logf("%s", scenario)
	wal, cpu := map[string][]float64{}, map[string][]float64{}
	ts := []trial{{system: minimal, higherBetter: true, run: func() float64 {
		url := b.freshDB(ctx)
		defer b.dropDB(ctx, url)
		db := open(ctx, url, 4)
		defer db.Close()
		if _, err := db.Exec(ctx, minimalSchemaSQL); err != nil {
			fail(fmt.Errorf("minimal queue: schema: %w", err))
		}
		start := walLSN(ctx, db)
		if _, err := db.Exec(ctx, `INSERT INTO minq.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)`, n); err != nil {
			fail(fmt.Errorf("minimal queue: insert: %w", err))
		}
		if _, err := db.Exec(ctx, `VACUUM ANALYZE minq.jobs`); err != nil {
			fail(fmt.Errorf("minimal queue: analyze: %w", err))
		}
		m := startCost(ctx, db)
		rate := float64(n) / minimalDrain(ctx, db, n, 2).Seconds()
		wal[minimal] = append(wal[minimal], walSince(ctx, db, start)/float64(n))
		cpu[minimal] = append(cpu[minimal], perJob(m.stop().server, n))
		return rate
	}}}
	for i, v := range schemaVariants {
		if picked := variantsPicked(); len(picked) > 0 && !slices.Contains(picked, i) {
			continue
		}
		name := "leash, " + v.name
		t := trial{system: name, higherBetter: true, baseline: []string{minimal}, run: func() float64 {
			url := b.freshDB(ctx)
			defer b.dropDB(ctx, url)
			db := open(ctx, url, 10)
			defer db.Close()
			if v.sql != "" {
				if _, err := db.Exec(ctx, v.sql); err != nil {
					fail(fmt.Errorf("variant %q: %w", v.name, err))
				}
			}
			start := walLSN(ctx, db)
			leashInsertNoops(ctx, db, n)
			cnt := newCounter(n)
			p := newLeashConfig(db, pool.Config{Concurrency: 100, Observer: cnt})
			m := startCost(ctx, db)
			rate := float64(n) / leashDrain(ctx, p, cnt).Seconds()
			cpu[name] = append(cpu[name], perJob(m.stop().server, n))
			wal[name] = append(wal[name], walSince(ctx, db, start)/float64(n))
			return rate
		}}
		if i > 0 {
			t.baseline = append(t.baseline, "leash, "+schemaVariants[0].name)
		}
		ts = append(ts, t)
	}
	b.trials(scenario, "jobs/s", "jobs/s", ts)
	for _, t := range ts {
		r := row{scenario: scenario, system: t.system, metric: "WAL per job", value: median(wal[t.system]), unit: "B",
			baseline: t.baseline, runs: wal[t.system]}
		b.add(r)
	}
	for _, t := range ts {
		if v := median(cpu[t.system]); v >= 0 {
			b.add(row{scenario: scenario, system: t.system, metric: "server CPU per job (drain)", value: v, unit: "µs",
				baseline: t.baseline, runs: cpu[t.system]})
		}
	}
}

// walLSN is the server's current WAL insert position.
func walLSN(ctx context.Context, db *pgxpool.Pool) string {
	var lsn string
	if err := db.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		fail(fmt.Errorf("read WAL position: %w", err))
	}
	return lsn
}

// walSince is the WAL written server-wide since lsn, in bytes: the trial's own, as the bench
// runs one trial at a time (autovacuum and other databases add a little).
func walSince(ctx context.Context, db *pgxpool.Pool, lsn string) float64 {
	var d float64
	if err := db.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)`, lsn).Scan(&d); err != nil {
		fail(fmt.Errorf("read WAL position: %w", err))
	}
	return d
}

var flagVariants = flag.String("variants", "", "comma-separated positions of the schema ablation's variants to run (0: leash as migrated); empty: all")

func variantsPicked() []int {
	var out []int
	for _, f := range strings.Split(*flagVariants, ",") {
		if f == "" {
			continue
		}
		i, err := strconv.Atoi(f)
		if err != nil {
			fail(fmt.Errorf("-variants: %w", err))
		}
		out = append(out, i)
	}
	return out
}
