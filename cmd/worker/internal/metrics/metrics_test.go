package metrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/leashq/leash/cmd/worker/internal/metrics"
	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// finished is an Observer passing finished jobs to the test after the metrics observer counted
// them.
type finished struct {
	*metrics.Observer
	done chan pool.JobEvent
}

func (f finished) JobFinished(ev pool.JobEvent) {
	f.Observer.JobFinished(ev)
	f.done <- ev
}

// TestMetricsPassPromlint gathers every family the worker exposes, from the registry it builds,
// with a pool running and jobs counted in every labelled family, and fails on any problem
// promlint finds (names, units, _total on counters, help texts).
func TestMetricsPassPromlint(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	reg := prometheus.NewRegistry()
	obs := finished{Observer: metrics.NewObserver(reg), done: make(chan pool.JobEvent, 10)}
	p, err := pool.New(db, pool.Config{Observer: obs, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	p.Register("ok", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }))
	metrics.RegisterPool(reg, p, db)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		<-done
	})
	if _, err := pool.Insert(context.Background(), db, "ok", nil, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-obs.done:
	case <-time.After(20 * time.Second):
		t.Fatal("no job finished")
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, want := range []string{"leash_jobs_claimed_total", "leash_jobs_finished_total", "leash_job_duration_seconds",
		"leash_lease_renewals_total", "go_goroutines", "process_cpu_seconds_total"} {
		if !names[want] {
			t.Errorf("family %s not gathered", want)
		}
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, pr := range problems {
		t.Errorf("%s: %s", pr.Metric, pr.Text)
	}
}

// gathered returns the value of family name with label value label (any label when empty), and
// whether it was gathered.
func gathered(t *testing.T, reg *prometheus.Registry, name, label string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label != "" && (len(m.GetLabel()) == 0 || m.GetLabel()[0].GetValue() != label) {
				continue
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue(), true
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// leash_jobs_waiting_on_key_limit counts, per queue of the worker with a per-key limit, the due
// jobs not yet started of the keys at their limit; a queue without one has no series.
func TestJobsWaitingOnKeyLimitGauge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, "kq", 2); err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(db, pool.Config{Queues: []string{"kq", "plain"}})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	metrics.RegisterPool(reg, p, db)
	if v, ok := gathered(t, reg, "leash_jobs_waiting_on_key_limit", "kq"); !ok || v != 0 {
		t.Fatalf("empty queue: %v %v; want 0", v, ok)
	}
	// Key a: 2 holders (at the limit) and 3 due, 1 scheduled later; key b: 1 holder and 4 due
	// (room left); jobs in "plain" are not counted.
	for _, j := range []struct {
		queue, key string
		n          int
		later      bool
	}{{"kq", "a", 5, false}, {"kq", "a", 1, true}, {"kq", "b", 5, false}, {"plain", "a", 3, false}} {
		for range j.n {
			o := &pool.InsertOpts{Queue: j.queue, ConcurrencyKey: j.key}
			if j.later {
				o.RunAt = time.Now().Add(time.Hour)
			}
			if _, err := pool.Insert(ctx, db, "w", nil, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := db.Exec(ctx, `
		UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(), leased_by = 'w',
		       lease_token = id, lease_expires_at = now() + interval '1 hour'
		WHERE id IN (SELECT id FROM leash.jobs WHERE queue = 'kq' AND concurrency_key = 'a' ORDER BY id LIMIT 2)
		   OR id IN (SELECT id FROM leash.jobs WHERE queue = 'kq' AND concurrency_key = 'b' ORDER BY id LIMIT 1)`); err != nil {
		t.Fatal(err)
	}
	if v, ok := gathered(t, reg, "leash_jobs_waiting_on_key_limit", "kq"); !ok || v != 3 {
		t.Fatalf("kq: %v %v; want 3", v, ok)
	}
	if _, ok := gathered(t, reg, "leash_jobs_waiting_on_key_limit", "plain"); ok {
		t.Fatal("a queue without a per-key limit has a series")
	}
}

// leash_jobs_waiting_on_key_rate_limit counts, per queue of the worker with a per-key rate limit,
// the due jobs not yet started of the keys with no room under it; a queue without one has no
// series.
func TestJobsWaitingOnKeyRateGauge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	if err := pool.SetQueueKeyRateLimit(ctx, db, "kr", 1, time.Hour); err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(db, pool.Config{Queues: []string{"kr", "plain"}})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	metrics.RegisterPool(reg, p, db)
	for _, k := range []string{"spent", "spent", "spent", "fresh", "fresh"} {
		if _, err := pool.Insert(ctx, db, "w", nil, &pool.InsertOpts{Queue: "kr", ConcurrencyKey: k}); err != nil {
			t.Fatal(err)
		}
	}
	if v, ok := gathered(t, reg, "leash_jobs_waiting_on_key_rate_limit", "kr"); !ok || v != 0 {
		t.Fatalf("no key out of room: %v %v; want 0", v, ok)
	}
	// Key spent started within the hour, as a claim records it: its 3 due jobs wait.
	if _, err := db.Exec(ctx, `INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kr', 'spent', ARRAY[now()])`); err != nil {
		t.Fatal(err)
	}
	if v, ok := gathered(t, reg, "leash_jobs_waiting_on_key_rate_limit", "kr"); !ok || v != 3 {
		t.Fatalf("kr: %v %v; want 3", v, ok)
	}
	if _, ok := gathered(t, reg, "leash_jobs_waiting_on_key_rate_limit", "plain"); ok {
		t.Fatal("a queue without a per-key rate limit has a series")
	}
}

// leash_claims_rate_limited_total is Stats.RateLimited: the claims that left a rate-limited queue
// at its limit.
func TestClaimsRateLimitedCounter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	if err := pool.SetQueueRateLimit(ctx, db, "rq", 1, time.Hour); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	p, err := pool.New(db, pool.Config{Queues: []string{"rq"}, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan struct{}, 10)
	p.Register("ok", pool.HandlerFunc(func(context.Context, *pool.Job) error { ran <- struct{}{}; return nil }))
	metrics.RegisterPool(reg, p, db)
	if v, ok := gathered(t, reg, "leash_claims_rate_limited_total", ""); !ok || v != 0 {
		t.Fatalf("before any claim: %v %v; want 0", v, ok)
	}
	for range 3 {
		if _, err := pool.Insert(ctx, db, "ok", nil, &pool.InsertOpts{Queue: "rq"}); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		<-done
	})
	select {
	case <-ran:
	case <-time.After(20 * time.Second):
		t.Fatal("no job ran")
	}
	deadline := time.Now().Add(20 * time.Second)
	for p.Stats().RateLimited == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no claim left the queue at its limit")
		}
		time.Sleep(10 * time.Millisecond)
	}
	before := p.Stats().RateLimited
	v, ok := gathered(t, reg, "leash_claims_rate_limited_total", "")
	if after := p.Stats().RateLimited; !ok || v < float64(before) || v > float64(after) {
		t.Fatalf("leash_claims_rate_limited_total %v (%v); Stats.RateLimited %d then %d", v, ok, before, after)
	}
	if c := p.Stats().Claimed; c != 1 {
		t.Fatalf("%d jobs started under a limit of 1 per hour", c)
	}
}
