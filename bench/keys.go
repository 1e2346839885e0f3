package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/pool"
)

var flagKeys = flag.Int("keys", 100000, "distinct keys of the keys scenario's claim-cost measurement (half of them at their limit)")

// keys measures what per-key concurrency (max_running_per_key) costs. First, the claim: the mean
// time of a claim of 10 jobs from a queue of -keys distinct keys (3 jobs each) with a per-key
// limit of 1, half the keys at their limit (their first job running), against the same claim
// from an uncapped queue of as many jobs without a key. Then the burn-down of -jobs jobs of 1,000
// keys with a limit of 1 (each key's jobs one after the other) against the same jobs uncapped,
// 100 workers. River has no per-key concurrency in its open-source core (it is a River Pro
// feature), so leash without the limit is the baseline.
func (b *bench) keys(ctx context.Context) {
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
				jobs, err = store.ClaimKeyed(ctx, db, store.KeyedParams{ClaimParams: p})
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
