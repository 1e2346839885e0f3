package pool_test

import (
	"bytes"
	"context"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"weak"

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

// A runner waiting for its next attempt holds nothing of the last one: a job whose attempt
// ended (its payload, its output, its lease, its context) is garbage once its outcome is
// written, even when no other job comes to that runner.
func TestIdleRunnerLetsItsLastJobGo(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Concurrency = 1
	ran := make(chan weak.Pointer[pool.Job], 1)
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"big": pool.HandlerFunc(func(_ context.Context, j *pool.Job) error {
		ran <- weak.Make(j)
		return nil
	})})
	if _, err := pool.Insert(context.Background(), b.db, "big", map[string]string{"blob": strings.Repeat("x", 1<<20)}, nil); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	wp := <-ran
	b.events.wait(t, 1, 20*time.Second)
	deadline := time.Now().Add(3 * time.Second)
	for wp.Value() != nil {
		if time.Now().After(deadline) {
			t.Fatal("the job of the last attempt is still reachable 3s after its outcome was written, the runner idle")
		}
		runtime.GC()
		runtime.Gosched()
	}
}

// goroutineID is the id of the calling goroutine, from its stack's header.
func goroutineID() string {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	id, _, _ := bytes.Cut(bytes.TrimPrefix(buf, []byte("goroutine ")), []byte(" "))
	return string(id)
}

// labelsOfThisGoroutine is the profiler labels of the calling goroutine, as the goroutine
// profile shows them ("" for none).
//
//go:noinline
func labelsOfThisGoroutine() string {
	var b bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&b, 1); err != nil {
		return err.Error()
	}
	for rec := range strings.SplitSeq(b.String(), "\n\n") {
		if !strings.Contains(rec, "pool_test.labelsOfThisGoroutine") {
			continue
		}
		for line := range strings.SplitSeq(rec, "\n") {
			if l, ok := strings.CutPrefix(line, "# labels: "); ok {
				return l
			}
		}
		return ""
	}
	return "(goroutine not found)"
}

// The profiler labels a handler sets on its goroutine (pprof.SetGoroutineLabels, as profiling
// by kind or job does) end with its attempt: the next job run on the same goroutine starts with
// the labels of Run's context, as it did on a goroutine of its own, not with its predecessor's.
func TestHandlerProfilerLabelsEndWithTheAttempt(t *testing.T) {
	t.Parallel()
	const jobs = 10
	cfg := fastConfig()
	cfg.Concurrency = 1
	type seen struct{ goroutine, labels string }
	ran := make(chan seen, jobs)
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"label": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		ran <- seen{goroutineID(), labelsOfThisGoroutine()}
		pprof.SetGoroutineLabels(pprof.WithLabels(ctx, pprof.Labels("job", strconv.FormatInt(j.ID, 10))))
		return nil
	})})
	params := make([]pool.InsertManyParams, jobs)
	for i := range params {
		params[i].Kind = "label"
	}
	if _, err := pool.InsertMany(context.Background(), b.db, params); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go pprof.Do(context.Background(), pprof.Labels("app", "worker"), func(ctx context.Context) { done <- p.Run(ctx) })
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p.Shutdown(ctx)
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	b.events.wait(t, jobs, 20*time.Second)
	goroutines := map[string]bool{}
	for range jobs {
		s := <-ran
		goroutines[s.goroutine] = true
		if s.labels != `{"app":"worker"}` {
			t.Errorf("a handler started with profiler labels %s; want Run's, {\"app\":\"worker\"}", s.labels)
		}
	}
	if len(goroutines) == jobs {
		t.Fatalf("%d jobs ran on %d goroutines: none was run on a goroutine an earlier job ran on", jobs, len(goroutines))
	}
}
