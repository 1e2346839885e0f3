package web

import (
	"fmt"
	"net/http"

	"github.com/leashq/leash/pool"
)

// keysTop bounds each list of keys on the queue page.
const keysTop = 20

// keyShownBytes bounds how much of a key the queue page shows (a key may be 1024 bytes).
const keyShownBytes = 80

// shortKey cuts a key to keyShownBytes, on a character boundary, marking the cut.
func shortKey(k string) string {
	if len(k) > keyShownBytes {
		return truncate(k, keyShownBytes) + "…"
	}
	return k
}

// queueData is the queue page: the queue's settings and counts, and a bounded look at its keys.
type queueData struct {
	Queue   pool.QueueState
	Keys    pool.QueueKeys
	Top     int
	Cap     int64
	Looked  int
	Refresh int
}

// queue serves /queues/{name}: the queue's limits, its keys at their per-key limit and its
// busiest keys (pool.ReadQueueKeys: bounded, index reads only).
func (s *server) queue(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if !validQueueName(name) {
		http.Error(w, "bad queue name", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	queues, err := pool.ListQueues(ctx, s.DB)
	if err != nil {
		s.fail(w, err)
		return
	}
	data := queueData{Top: keysTop, Cap: pool.KeyCountCap, Looked: 3 * pool.KeysLooked, Refresh: int(s.Refresh.Seconds())}
	found := false
	for _, q := range queues {
		if q.Name == name {
			data.Queue, found = q, true
		}
	}
	if !found {
		http.Error(w, fmt.Sprintf("queue %q has no settings and no jobs queued or running", truncate(name, 128)), http.StatusNotFound)
		return
	}
	if data.Keys, err = pool.ReadQueueKeys(ctx, s.DB, name, keysTop); err != nil {
		s.fail(w, err)
		return
	}
	s.render(w, "queue.html", data)
}
