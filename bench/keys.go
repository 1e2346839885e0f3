package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/pool"
)

var (
	flagKeys      = flag.Int("keys", 100000, "distinct keys of the keys scenario's claim-cost measurement (half of them at their limit)")
	flagKeysParts = flag.String("keys-parts", "claim,burn,triggers,turns", "comma-separated parts of the keys scenario: claim, burn, triggers (a burn-down without limits with and without migration 025's row triggers), turns (a new key's first job beside a key's backlog)")
)

// keys measures what per-key concurrency (max_running_per_key) costs. First, the claim: the mean
// time of a claim of 10 jobs from a queue of -keys distinct keys (3 jobs each) with a per-key
// limit of 1, half the keys at their limit (their first job running), against the same claim
// from an uncapped queue of as many jobs without a key. Then the burn-down of -jobs jobs of 1,000
// keys with a limit of 1 (each key's jobs one after the other) against the same jobs uncapped,
// 100 workers. River has no per-key concurrency in its open-source core (it is a River Pro
// feature), so leash without the limit is the baseline.
func (b *bench) keys(ctx context.Context) {
	parts := strings.Split(*flagKeysParts, ",")
	if slices.Contains(parts, "claim") {
		b.keysClaim(ctx)
	}
	if slices.Contains(parts, "burn") {
		b.keysBurn(ctx)
	}
	if slices.Contains(parts, "triggers") {
		b.keysTriggers(ctx)
	}
	if slices.Contains(parts, "turns") {
		b.keysTurns(ctx)
	}
}

func (b *bench) keysClaim(ctx context.Context) {
	nk := *flagKeys
	claimScenario := fmt.Sprintf("claim of 10, %d keys, half at their limit", nk)
	logf("%s", claimScenario)
	claims := min(500, nk/20) // each takes 10 of the keys with room
	measure := func(keyed bool) float64 {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		q := "default"
		if keyed {
			if err := pool.SetQueueMaxRunningPerKey(ctx, db, q, 1); err != nil {
				fail(err)
			}
		} else if err := store.EnsureQueues(ctx, db, []string{q}); err != nil {
			fail(err)
		}
		key := `NULL`
		if keyed {
			key = `'tenant-' || k`
		}
		if _, err := db.Exec(ctx, fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind, concurrency_key)
			SELECT 'default', 'noop', %s FROM generate_series(1, 3) i, generate_series(1, $1) k`, key), nk); err != nil {
			fail(err)
		}
		claim := func(limit int) int {
			p := store.ClaimParams{Queues: []string{q}, Limit: limit, WorkerID: "bench", Lease: time.Hour}
			var jobs []store.ClaimedJob
			var err error
			if keyed {
				jobs, _, err = store.ClaimKeyed(ctx, db, store.KeyedParams{ClaimParams: p})
			} else {
				jobs, err = store.Claim(ctx, db, p)
			}
			if err != nil {
				fail(err)
			}
			return len(jobs)
		}
		// Half the keys at their limit (the first half of the jobs, uncapped), every key's row built.
		for taken := 0; taken < nk/2; {
			taken += claim(min(1000, nk/2-taken))
		}
		for keyed {
			var wakes int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes WHERE key <> ''`).Scan(&wakes); err != nil {
				fail(err)
			}
			if wakes == 0 {
				break
			}
			claim(0)
		}
		if _, err := db.Exec(ctx, `VACUUM ANALYZE leash.jobs`); err != nil {
			fail(err)
		}
		if keyed {
			if _, err := db.Exec(ctx, `VACUUM ANALYZE leash.concurrency_keys`); err != nil {
				fail(err)
			}
		}
		began := time.Now()
		for range claims {
			if claim(10) != 10 {
				fail(fmt.Errorf("a claim of 10 took fewer"))
			}
		}
		return float64(time.Since(began).Microseconds()) / float64(claims)
	}
	b.trials(claimScenario, "claim", "µs", []trial{
		{system: "leash no limit", run: func() float64 { return measure(false) }},
		{system: "leash limit 1 per key", baseline: []string{"leash no limit"}, run: func() float64 { return measure(true) }},
	})
}

func (b *bench) keysBurn(ctx context.Context) {
	n := *flagJobs
	const slots, keyCount = 100, 1000
	burnScenario := fmt.Sprintf("burn-down %d, %d keys, %d workers", n, keyCount, slots)
	logf("%s", burnScenario)
	burn := func(limit int) float64 {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, "default", limit); err != nil {
			fail(err)
		}
		params := make([]pool.InsertManyParams, n)
		for i := range params {
			params[i] = pool.InsertManyParams{Kind: "noop", Opts: &pool.InsertOpts{ConcurrencyKey: fmt.Sprintf("tenant-%d", i%keyCount)}}
		}
		if _, err := pool.InsertMany(ctx, db, params); err != nil {
			fail(err)
		}
		cnt := newCounter(n)
		return float64(n) / leashDrain(ctx, newLeash(db, slots, cnt, nil), cnt).Seconds()
	}
	b.trials(burnScenario, "jobs/s", "jobs/s", []trial{
		{system: "leash no limit", higherBetter: true, run: func() float64 { return burn(-1) }},
		{system: "leash limit 1 per key", higherBetter: true, baseline: []string{"leash no limit"}, run: func() float64 { return burn(1) }},
	})
}

// keysTriggers measures what migration 025's row triggers on leash.jobs cost a queue without
// limits: the burn-down of -jobs no-op jobs, 100 workers, with the triggers and with them dropped,
// interleaved.
func (b *bench) keysTriggers(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("burn-down %d, no limits, 100 workers", n)
	logf("%s", scenario)
	burn := func(drop bool) float64 {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		if drop {
			for _, t := range []string{"jobs_key_inserted", "jobs_key_changed", "jobs_key_deleted", "jobs_unkeyed_inserted", "jobs_unkeyed_requeued"} {
				if _, err := db.Exec(ctx, "DROP TRIGGER "+t+" ON leash.jobs"); err != nil {
					fail(err)
				}
			}
		}
		leashInsertNoops(ctx, db, n)
		cnt := newCounter(n)
		return float64(n) / leashDrain(ctx, newLeash(db, 100, cnt, nil), cnt).Seconds()
	}
	b.trials(scenario, "jobs/s", "jobs/s", []trial{
		{system: "leash without 025's triggers", higherBetter: true, run: func() float64 { return burn(true) }},
		{system: "leash", higherBetter: true, baseline: []string{"leash without 025's triggers"}, run: func() float64 { return burn(false) }},
	})
}

// keysTurns measures how soon a new key's first job starts beside another key's backlog: key a
// has 100,000 jobs queued in a queue with a per-key limit of 5, its jobs take 2 ms, 20 workers;
// once they run, 20 jobs of new keys are inserted one at a time, 50 ms apart, and the time from
// each insert to its start is read from the database clock (attempted_at - created_at).
func (b *bench) keysTurns(ctx context.Context) {
	scenario := "new key beside a backlog of 100000, limit 5"
	logf("%s", scenario)
	measure := func() (p50, most float64) {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, "default", 5); err != nil {
			fail(err)
		}
		if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key)
			SELECT 'default', 'slow', 'a' FROM generate_series(1, 100000)`); err != nil {
			fail(err)
		}
		p := newLeash(db, 20, nil, map[string]pool.Handler{"slow": pool.HandlerFunc(func(ctx context.Context, _ *pool.Job) error {
			time.Sleep(2 * time.Millisecond)
			return nil
		})})
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go p.Run(rctx)
		defer p.Shutdown(context.Background())
		for { // a's jobs run
			var running int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state <> 'available'`).Scan(&running); err != nil {
				fail(err)
			}
			if running >= 50 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		const news = 20
		for i := range news {
			if _, err := pool.Insert(ctx, db, "noop", nil, &pool.InsertOpts{ConcurrencyKey: fmt.Sprintf("new-%d", i)}); err != nil {
				fail(err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		deadline := time.Now().Add(30 * time.Second)
		var waits []float64
		for time.Now().Before(deadline) {
			rows, err := db.Query(ctx, `SELECT extract(epoch FROM attempted_at - created_at) * 1000 FROM leash.jobs
				WHERE concurrency_key LIKE 'new-%' AND attempted_at IS NOT NULL`)
			if err != nil {
				fail(err)
			}
			waits = waits[:0]
			for rows.Next() {
				var ms float64
				if err := rows.Scan(&ms); err != nil {
					fail(err)
				}
				waits = append(waits, ms)
			}
			rows.Close()
			if len(waits) == news {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if len(waits) < news {
			return math.Inf(1), math.Inf(1)
		}
		slices.Sort(waits)
		return waits[len(waits)/2], waits[len(waits)-1]
	}
	var most float64
	b.trials(scenario, "first job's wait p50", "ms", []trial{{system: "leash limit 5 per key", run: func() float64 {
		p50, m := measure()
		most = max(most, m)
		return p50
	}}})
	b.trials(scenario, "first job's wait max", "ms", []trial{{system: "leash limit 5 per key", once: true, run: func() float64 { return most }}})
}
