package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/leashq/leash/pool"
)

var (
	flagSustainRate    = flag.Int("sustain-rate", 7000, "jobs/s offered in the sustained-load scenario (about 70% of the burn-down capacity)")
	flagSustainMinutes = flag.Int("sustain-minutes", 3, "minutes of each sustained-load run")
	flagSustainRuns    = flag.String("sustain-runs", "as-is,xmin-held", "which sustained-load runs: as-is, xmin-held")
	flagSustainSystems = flag.String("sustain-systems", "River tuned,leash", "systems in the sustained-load runs (also: "+leashFromFront+")")
)

// sustained: a steady offered rate from several producers for some minutes, once as is and once
// with another session holding a snapshot open (the xmin horizon held back, as a long report
// or a forgotten BEGIN does), for leash and River tuned. Per minute: completions and pickup
// p50/p99/max; at the end: dead tuples and sizes.
// leashFromFront is leash with every claim starting at the front of the index (the ablation of
// claims past the cursor).
const leashFromFront = "leash from the front"

func (b *bench) sustained(ctx context.Context) {
	rate, minutes := *flagSustainRate, *flagSustainMinutes
	runs := strings.Split(*flagSustainRuns, ",")
	for _, held := range []bool{false, true} {
		if !slices.Contains(runs, map[bool]string{false: "as-is", true: "xmin-held"}[held]) {
			continue
		}
		scenario := fmt.Sprintf("sustained %d jobs/s, %d min", rate, minutes)
		if held {
			scenario += ", xmin held"
		}
		logf("%s", scenario)
		for _, system := range strings.Split(*flagSustainSystems, ",") {
			b.sustainedRun(ctx, scenario, system, rate, minutes, held)
		}
	}
}

func (b *bench) sustainedRun(ctx context.Context, scenario, system string, rate, minutes int, held bool) {
	url := b.freshDB(ctx)
	// Dropped at the end: autovacuum would otherwise clean up millions of dead rows under the
	// next run.
	defer b.dropDB(ctx, url)
	db := open(ctx, url, 30)
	defer db.Close()
	if held {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			fail(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ"); err != nil {
			fail(err)
		}
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_class").Scan(&n); err != nil { // takes the snapshot
			fail(err)
		}
	}
	table := "leash.jobs"
	var stop func()
	insert := func(ctx context.Context, n int) error {
		params := make([]pool.InsertManyParams, n)
		for i := range params {
			params[i].Kind = "noop"
		}
		_, err := pool.InsertMany(ctx, db, params)
		return err
	}
	if leashSystem := strings.HasPrefix(system, "leash"); leashSystem {
		p := newLeash(db, 100, nil, nil)
		if system == leashFromFront {
			p = newLeashConfig(db, pool.Config{Concurrency: 100, Engine: pool.EngineConfig{ClaimFromFront: true}})
		}
		go p.Run(ctx)
		stop = func() { p.Shutdown(context.Background()) }
	} else {
		table = "river_job"
		c := newRiver(db, 100, riverTuned, nil)
		if err := c.Start(ctx); err != nil {
			fail(err)
		}
		stop = func() { stopRiver(c) }
		insert = func(ctx context.Context, n int) error {
			params := make([]river.InsertManyParams, n)
			for i := range params {
				params[i] = river.InsertManyParams{Args: noopArgs{}}
			}
			_, err := c.InsertMany(ctx, params)
			return err
		}
	}
	// Four producers, each inserting a small batch every 10 ms.
	const producers = 4
	per := max(rate/producers/100, 1)
	began := time.Now()
	end := began.Add(time.Duration(minutes) * time.Minute)
	var wg sync.WaitGroup
	for range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for time.Now().Before(end) {
				if err := insert(ctx, per); err != nil {
					fail(err)
				}
				<-tick.C
			}
		}()
	}
	wg.Wait()
	// Let the backlog drain (bounded), then stop.
	drainUntil := time.Now().Add(time.Minute)
	for time.Now().Before(drainUntil) {
		q := "SELECT count(*) FROM river_job WHERE finalized_at IS NULL"
		if strings.HasPrefix(system, "leash") {
			q = "SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled')"
		}
		var open int
		if err := db.QueryRow(ctx, q).Scan(&open); err != nil {
			fail(err)
		}
		if open == 0 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	stop()
	b.sustainedReport(ctx, db, scenario, system, table, began, minutes)
}

// sustainedReport adds, per minute since began: jobs started, pickup p50, p99 and max; then dead
// tuples and total size of the table with its indexes.
func (b *bench) sustainedReport(ctx context.Context, db *pgxpool.Pool, scenario, system, table string, began time.Time, minutes int) {
	rows, err := db.Query(ctx, "SELECT created_at, attempted_at FROM "+table+" WHERE attempted_at IS NOT NULL")
	if err != nil {
		fail(err)
	}
	perMinute := make([][]time.Duration, minutes)
	for rows.Next() {
		var created, attempted time.Time
		if err := rows.Scan(&created, &attempted); err != nil {
			fail(err)
		}
		m := int(attempted.Sub(began) / time.Minute)
		if m >= 0 && m < minutes {
			perMinute[m] = append(perMinute[m], attempted.Sub(created))
		}
	}
	rows.Close()
	for m, lat := range perMinute {
		slices.Sort(lat)
		base := []string{}
		switch system {
		case "leash":
			base = []string{"River tuned"}
		case leashFromFront:
			base = []string{"leash"}
		}
		b.add(row{scenario: scenario, system: system, metric: fmt.Sprintf("min %d started", m+1), value: float64(len(lat)) / 60, unit: "jobs/s", baseline: base, higherBetter: true})
		b.add(row{scenario: scenario, system: system, metric: fmt.Sprintf("min %d pickup p50", m+1), value: ms(percentile(lat, 50)), unit: "ms", baseline: base})
		b.add(row{scenario: scenario, system: system, metric: fmt.Sprintf("min %d pickup p99", m+1), value: ms(percentile(lat, 99)), unit: "ms", baseline: base})
		if len(lat) > 0 {
			b.add(row{scenario: scenario, system: system, metric: fmt.Sprintf("min %d pickup max", m+1), value: ms(lat[len(lat)-1]), unit: "ms", baseline: base})
		}
	}
	var dead int64
	var size int64
	name := table
	db.QueryRow(ctx, "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass", name).Scan(&dead)
	db.QueryRow(ctx, "SELECT pg_total_relation_size($1::regclass)", name).Scan(&size)
	b.add(row{scenario: scenario, system: system, metric: "dead tuples at end", value: float64(dead), unit: "rows"})
	b.add(row{scenario: scenario, system: system, metric: "table+indexes at end", value: float64(size) / (1 << 20), unit: "MB"})
}
