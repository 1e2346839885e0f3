package pool

import (
	"sync"
	"time"

	"github.com/leashq/leash/internal/store"
)

// unkeyedProbes decides when the claim of a queue with a per-key limit also looks for the queue's
// jobs without a key. That look walks the queue's claim index past its jobs with a key, which
// leash.concurrency_keys spares the rest of the claim: so it is made at every claim only while it
// keeps finding such jobs, and otherwise once per poll interval (a job without a key inserted into
// a queue whose backlog is all keyed waits at most that long, plus the claim's own time).
type unkeyedProbes struct {
	mu   sync.Mutex
	last map[string]unkeyedProbe
}

type unkeyedProbe struct {
	at    time.Time
	found bool
}

// due reports whether the next claim of queue looks for jobs without a key.
func (u *unkeyedProbes) due(queue string, every time.Duration) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	pr, ok := u.last[queue]
	return !ok || pr.found || time.Since(pr.at) >= every
}

// record notes what a claim that looked for jobs without a key found.
func (u *unkeyedProbes) record(queue string, jobs []store.ClaimedJob) {
	found := false
	for i := range jobs {
		found = found || jobs[i].ConcurrencyKey == ""
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.last == nil {
		u.last = make(map[string]unkeyedProbe)
	}
	u.last[queue] = unkeyedProbe{at: time.Now(), found: found}
}
