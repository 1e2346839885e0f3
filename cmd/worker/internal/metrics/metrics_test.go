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
