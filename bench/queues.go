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
func (b *bench) queueCap(ctx context.Context) {
	n := *flagJobs
	const slots = 100
	scenario := fmt.Sprintf("capped queue, burn-down %d, %d workers", n, slots)
	logf("%s", scenario)
	variants := []struct {
		name string
		cap  int
	}{{"leash uncapped", -1}, {"leash cap 1000", 1000}, {"leash cap 50", 50}}
	var ts []trial
	for i, v := range variants {
		t := trial{system: v.name, higherBetter: true, run: func() float64 {
			db := open(ctx, b.freshDB(ctx), 10)
			defer db.Close()
			if err := pool.SetQueueMaxRunning(ctx, db, "default", v.cap); err != nil {
				fail(err)
			}
			leashInsertNoops(ctx, db, n)
			cnt := newCounter(n)
			return float64(n) / leashDrain(ctx, newLeash(db, slots, cnt, nil), cnt).Seconds()
		}}
		if i > 0 {
			t.baseline = []string{"leash uncapped"}
		}
		ts = append(ts, t)
	}
	b.trials(scenario, "jobs/s", "jobs/s", ts)
}
