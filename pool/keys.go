package pool

import (
	"sync"
	"time"

	"github.com/leashq/leash/internal/store"
)

// unkeyedProbes decides when the claim of a queue with a per-key limit looks for the queue's jobs
// without a key even if none was inserted or queued again since the last look (the claim looks
// then by itself, see store.ClaimKeyed). That look walks the queue's claim index past its jobs
// with a key, which leash.concurrency_keys spares the rest of the claim: so it is made at every
// claim while it keeps finding such jobs, and otherwise every unkeyedEvery poll intervals, for a
// job scheduled for later, which becomes runnable without any write (it starts that much late at
// most).
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
	return !ok || pr.found || time.Since(pr.at) >= unkeyedEvery*every
}

// unkeyedEvery is how many poll intervals apart the claims of a queue with a per-key limit look
// for jobs without a key when they have no other reason to.
const unkeyedEvery = 10

// record notes what a claim found: probed, it was asked to look for jobs without a key; it also
// looked by itself when it returns some.
func (u *unkeyedProbes) record(queue string, jobs []store.ClaimedJob, probed bool) {
	found := false
	for i := range jobs {
		found = found || jobs[i].ConcurrencyKey == ""
	}
	if !probed && !found {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.last == nil {
		u.last = make(map[string]unkeyedProbe)
	}
	u.last[queue] = unkeyedProbe{at: time.Now(), found: found}
}
