package pool_test

import (
	"bytes"
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/leashq/leash/pool"
)

// Handlers run on goroutines kept from job to job, not on one goroutine per job: there are never
// many more of them than slots, however many jobs run.
func TestHandlerGoroutinesKeptFromJobToJob(t *testing.T) {
	t.Parallel()
	const jobs = 60
	cfg := fastConfig()
	cfg.Concurrency = 2
	var mu sync.Mutex
	seen := map[string]bool{}
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"who": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		buf := make([]byte, 64)
		buf = buf[:runtime.Stack(buf, false)]
		id, _, _ := bytes.Cut(bytes.TrimPrefix(buf, []byte("goroutine ")), []byte(" "))
		mu.Lock()
		seen[string(id)] = true
		mu.Unlock()
		return nil
	})})
	params := make([]pool.InsertManyParams, jobs)
	for i := range params {
		params[i].Kind = "who"
	}
	if _, err := pool.InsertMany(context.Background(), b.db, params); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	b.events.wait(t, jobs, 20*time.Second)
	mu.Lock()
	defer mu.Unlock()
	// A slot freed while its goroutine is still on its way back to waiting may start a job on a
	// new goroutine: a few more than the slots.
	if n := len(seen); n > 2*cfg.Concurrency+2 {
		t.Fatalf("%d jobs ran on %d goroutines with %d slots; want at most %d", jobs, n, cfg.Concurrency, 2*cfg.Concurrency+2)
	}
}
