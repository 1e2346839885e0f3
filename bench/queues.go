package main

import (
	"context"
	"fmt"

	"github.com/leashq/leash/pool"
)

// queueCap measures what a cap on a queue's running jobs costs: burn-down of the same queue
// uncapped, capped above the worker's slots (the cap never binds: the cost is the capped claim
// path alone, a lock on the queue's row and a count of its running jobs per claim) and capped
// at half the slots. River has no cap in its open-source core, so leash uncapped is the baseline.
// Each variant runs twice, interleaved, and the better run counts, to damp this machine's noise.
func (b *bench) queueCap(ctx context.Context) {
	n := *flagJobs
	const slots = 100
	scenario := fmt.Sprintf("capped queue, burn-down %d, %d workers", n, slots)
	logf("%s", scenario)
	variants := []struct {
		name string
		cap  int
	}{{"leash uncapped", -1}, {"leash cap 1000", 1000}, {"leash cap 50", 50}}
	best := make([]float64, len(variants))
	for range 2 {
		for i, v := range variants {
			db := open(ctx, b.freshDB(ctx), 10)
			if err := pool.SetQueueMaxRunning(ctx, db, "default", v.cap); err != nil {
				fail(err)
			}
			leashInsertNoops(ctx, db, n)
			cnt := newCounter(n)
			d := leashDrain(ctx, newLeash(db, slots, cnt, nil), cnt)
			best[i] = max(best[i], float64(n)/d.Seconds())
			db.Close()
		}
	}
	for i, v := range variants {
		r := row{scenario: scenario, system: v.name, metric: "jobs/s", value: best[i], unit: "jobs/s", higherBetter: true}
		if i > 0 {
			r.baseline = []string{"leash uncapped"}
		}
		b.add(r)
	}
}
