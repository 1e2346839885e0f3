package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

var flagRate = flag.Int("rate", 2000, "the rate scenario's limit, starts per second")

// rate measures a queue's rate limit (-rate starts per second) on a backlog, beside an unlimited
// queue on the same workers (two pools of 50 slots, both queues): the rated queue's starts per
// second over 5 s after 1 s of warm-up, and the most starts in any 1 s window of the whole run
// (from attempted_at in the database), against the limit; and the unlimited queue's completions
// per second, against the same workers serving it alone.
func (b *bench) rate(ctx context.Context) {
	limit := *flagRate
	scenario := fmt.Sprintf("rate %d/s beside an unlimited queue, 2x50 slots", limit)
	logf("%s", scenario)
	const warm, span = time.Second, 5 * time.Second
	run := func(rated bool) (free, starts, most float64) {
		db := open(ctx, b.freshDB(ctx), 20)
		defer db.Close()
		queues := []string{"free"}
		if rated {
			queues = append(queues, "rated")
			if err := pool.SetQueueRateLimit(ctx, db, "rated", limit, time.Second); err != nil {
				fail(err)
			}
			rateInsert(ctx, db, "rated", limit*int((warm+span)/time.Second+3))
		}
		rateInsert(ctx, db, "free", 150000)
		if _, err := db.Exec(ctx, `VACUUM ANALYZE leash.jobs`); err != nil {
			fail(err)
		}
		var ps []*pool.Pool
		for range 2 {
			p, err := pool.New(db, pool.Config{Concurrency: 50, Queues: queues})
			if err != nil {
				fail(err)
			}
			p.Register("noop", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }))
			go p.Run(ctx)
			ps = append(ps, p)
		}
		time.Sleep(warm)
		t0 := rateNow(ctx, db)
		time.Sleep(span)
		t1 := rateNow(ctx, db)
		for _, p := range ps {
			p.Shutdown(context.Background())
		}
		secs := t1.Sub(t0).Seconds()
		var nFree, nStarts, nMost int64
		if err := db.QueryRow(ctx, `
			SELECT (SELECT count(*) FROM leash.jobs WHERE queue = 'free' AND state = 'completed' AND finished_at >= $1 AND finished_at < $2),
			       (SELECT count(*) FROM leash.jobs WHERE queue = 'rated' AND attempted_at >= $1 AND attempted_at < $2),
			       (SELECT coalesce(max(n), 0) FROM (
			            SELECT count(*) OVER (ORDER BY attempted_at RANGE BETWEEN CURRENT ROW AND interval '999999 microseconds' FOLLOWING) AS n
			            FROM leash.jobs WHERE queue = 'rated' AND attempted_at IS NOT NULL) w)`, t0, t1).Scan(&nFree, &nStarts, &nMost); err != nil {
			fail(err)
		}
		return float64(nFree) / secs, float64(nStarts) / secs, float64(nMost)
	}
	var alone, beside, starts, most []float64
	for round := range max(*flagRepeat, 1) {
		f, _, _ := run(false)
		alone = append(alone, f)
		logf("  %-28s %-22s %12.0f jobs/s (run %d)", scenario, "unlimited queue alone", f, round+1)
		f, s, m := run(true)
		beside, starts, most = append(beside, f), append(starts, s), append(most, m)
		logf("  %-28s %-22s %12.0f jobs/s, rated %.0f starts/s, most %.0f in 1 s (run %d)", scenario, "beside the rated queue", f, s, m, round+1)
	}
	b.add(row{scenario: scenario, system: "limit", metric: "starts/s", value: float64(limit), unit: "starts/s"})
	b.add(row{scenario: scenario, system: "rated queue", metric: "starts/s", value: median(starts), unit: "starts/s",
		baseline: []string{"limit"}, higherBetter: true, runs: starts})
	b.add(row{scenario: scenario, system: "limit", metric: "most starts in any 1 s", value: float64(limit), unit: "starts"})
	b.add(row{scenario: scenario, system: "rated queue", metric: "most starts in any 1 s", value: median(most), unit: "starts",
		baseline: []string{"limit"}, runs: most})
	b.add(row{scenario: scenario, system: "unlimited queue alone", metric: "jobs/s", value: median(alone), unit: "jobs/s",
		higherBetter: true, runs: alone})
	b.add(row{scenario: scenario, system: "unlimited beside rated", metric: "jobs/s", value: median(beside), unit: "jobs/s",
		baseline: []string{"unlimited queue alone"}, higherBetter: true, runs: beside})
	total := make([]float64, len(beside))
	for i := range beside {
		total[i] = beside[i] + starts[i]
	}
	b.add(row{scenario: scenario, system: "both queues", metric: "jobs/s", value: median(total), unit: "jobs/s",
		baseline: []string{"unlimited queue alone"}, higherBetter: true, runs: total})
}

func rateInsert(ctx context.Context, db *pgxpool.Pool, queue string, n int) {
	params := make([]pool.InsertManyParams, n)
	for i := range params {
		params[i] = pool.InsertManyParams{Kind: "noop", Opts: &pool.InsertOpts{Queue: queue}}
	}
	if _, err := pool.InsertMany(ctx, db, params); err != nil {
		fail(err)
	}
}

func rateNow(ctx context.Context, db *pgxpool.Pool) time.Time {
	var t time.Time
	if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t); err != nil {
		fail(err)
	}
	return t
}
