// Package metrics exposes a pool's counters in Prometheus format for the worker binary. The
// library itself records plain counters (pool.Stats) and events (pool.Observer), so embedding
// applications are free to use any metrics backend.
package metrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/leashq/leash/pool"
)

// Observer records per-job events; install it as pool.Config.Observer.
type Observer struct {
	claimed  *prometheus.CounterVec
	finished *prometheus.CounterVec
	duration *prometheus.HistogramVec
	pickup   *prometheus.HistogramVec
}

// NewObserver creates the per-job metrics and registers them on reg.
func NewObserver(reg prometheus.Registerer) *Observer {
	o := &Observer{
		claimed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leash_jobs_claimed_total",
			Help: "Jobs claimed (attempts started), by queue and kind."}, []string{"queue", "kind"}),
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leash_jobs_finished_total",
			Help: "Attempts finished, by queue, kind and resulting state (completed, retryable, failed, cancelled, available = handed back, lost = lease lost, stale = outcome rejected by the fence)."},
			[]string{"queue", "kind", "state"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "leash_job_duration_seconds",
			Help: "Handler run time, by queue and kind.", Buckets: prometheus.ExponentialBuckets(0.0005, 4, 12)},
			[]string{"queue", "kind"}),
		pickup: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "leash_job_pickup_latency_seconds",
			Help:    "Time from a job becoming runnable to its attempt starting (database clock), by queue.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 12)}, []string{"queue"}),
	}
	reg.MustRegister(o.claimed, o.finished, o.duration, o.pickup)
	return o
}

// JobStarted implements pool.StartObserver.
func (o *Observer) JobStarted(ev pool.JobEvent) {
	o.claimed.WithLabelValues(ev.Queue, ev.Kind).Inc()
	o.pickup.WithLabelValues(ev.Queue).Observe(ev.Pickup.Seconds())
}

// JobFinished implements pool.Observer.
func (o *Observer) JobFinished(ev pool.JobEvent) {
	state := ev.State
	switch {
	case ev.Stale:
		state = "stale"
	case state == "":
		state = "lost"
	}
	o.finished.WithLabelValues(ev.Queue, ev.Kind, state).Inc()
	o.duration.WithLabelValues(ev.Queue, ev.Kind).Observe(ev.Duration.Seconds())
}

// RegisterPool exposes the pool's counters and gauges, and the server's notification queue usage,
// on reg.
func RegisterPool(reg prometheus.Registerer, p *pool.Pool, db pool.DB) {
	// stat reads one count from a fresh snapshot, at scrape time.
	stat := func(f func(pool.Stats) int64) func() int64 { return func() int64 { return f(p.Stats()) } }
	counter := func(name, help string, f func() int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f()) })
	}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f)
	}
	labelled := func(name, help, label string, values map[string]func() int64) prometheus.Collector {
		return &funcVec{desc: prometheus.NewDesc(name, help, []string{label}, nil), values: values}
	}
	concurrency := float64(p.Config().Concurrency)
	reg.MustRegister(
		gauge("leash_slots_busy", "Job slots running a handler.", func() float64 { return float64(p.Busy()) }),
		gauge("leash_slots_idle", "Job slots free.", func() float64 { return concurrency - float64(p.Busy()) }),
		labelled("leash_lease_renewals_total", "Lease renewals by outcome: succeeded, failed (statement error), lost (the row no longer held the lease), skipped (the row was locked by another transaction).", "outcome",
			map[string]func() int64{"succeeded": stat(func(s pool.Stats) int64 { return s.Lease.RenewalsSucceeded }), "failed": stat(func(s pool.Stats) int64 { return s.Lease.RenewalsFailed }), "lost": stat(func(s pool.Stats) int64 { return s.Lease.RenewalsLost }),
				"skipped": stat(func(s pool.Stats) int64 { return s.Lease.RenewalsSkipped })}),
		labelled("leash_leases_ended_total", "Leases ended before their job finished, by cause.", "cause",
			map[string]func() int64{"revoked": stat(func(s pool.Stats) int64 { return s.Lease.EndedRevoked }), "lost": stat(func(s pool.Stats) int64 { return s.Lease.EndedLost }),
				"renewal_timeout": stat(func(s pool.Stats) int64 { return s.Lease.EndedTimeout }), "shutdown": stat(func(s pool.Stats) int64 { return s.Lease.EndedShutdown })}),
		labelled("leash_revocations_total", "Revocations that reached a running job, by the path that brought them.", "path",
			map[string]func() int64{"notification": stat(func(s pool.Stats) int64 { return s.RevokedByNotification }), "renewal": stat(func(s pool.Stats) int64 { return s.Lease.RevokedByRenewal }),
				"reconnect_recheck": stat(func(s pool.Stats) int64 { return s.Lease.RevokedByRecheck })}),
		counter("leash_stale_writes_total", "Writes rejected by the lease fence (the claim no longer held the job).", stat(func(s pool.Stats) int64 { return s.StaleWrites })),
		counter("leash_jobs_rescued_total", "Expired leases this worker took back.", stat(func(s pool.Stats) int64 { return s.Lease.Rescued })),
		counter("leash_handler_panics_total", "Handler panics recovered.", stat(func(s pool.Stats) int64 { return s.Panics })),
		counter("leash_jobs_timed_out_total", "Attempts cancelled by their timeout.", stat(func(s pool.Stats) int64 { return s.TimedOut })),
		counter("leash_claims_rate_limited_total", "Claims of a rate-limited queue that left it at its limit (the worker passes over it until its next start is allowed).", stat(func(s pool.Stats) int64 { return s.RateLimited })),
		counter("leash_jobs_set_aside_total", "Queued rows a claim failed instead of running, because no claim can take them (an attempt counter at its limit).", stat(func(s pool.Stats) int64 { return s.SetAside })),
		counter("leash_jobs_abandoned_total", "Jobs left to their lease at shutdown because the handler ignored cancellation.", stat(func(s pool.Stats) int64 { return s.Abandoned })),
		counter("leash_listener_backends_terminated_total", "Stranded LISTEN backends of earlier listener connections terminated.", stat(func(s pool.Stats) int64 { return s.Listener.Terminated })),
		counter("leash_jobs_pruned_total", "Finished jobs deleted by retention.", stat(func(s pool.Stats) int64 { return s.Pruned })),
		counter("leash_scheduled_jobs_total", "Jobs this worker enqueued for schedule ticks (leash.schedules).", stat(func(s pool.Stats) int64 { return s.ScheduledJobs })),
		counter("leash_schedule_errors_total", "Schedules refused for a spec the worker cannot use, and schedule ticks that could not be enqueued.", stat(func(s pool.Stats) int64 { return s.ScheduleErrors })),
		gauge("leash_handlers_stalled", "Handlers still running after their lease ended (they ignore cancellation).", func() float64 { return float64(p.Stats().Stalled) }),
		counter("leash_notifications_received_total", "Notifications received by the listener.", stat(func(s pool.Stats) int64 { return s.Listener.Received })),
		counter("leash_notifications_malformed_total", "job_revoked payloads that did not parse.", stat(func(s pool.Stats) int64 { return s.Listener.Malformed })),
		counter("leash_listener_reconnects_total", "Listener connections made after the first.", stat(func(s pool.Stats) int64 { return s.Listener.Reconnects })),
		labelled("leash_listener_wakes_total", "Notifications on the worker's own wake channel: heard (naming one of its queues), ignored (naming none: forged or garbage), held (a notification, on that channel or job_available, held back because the claims after the ones before found nothing).", "outcome",
			map[string]func() int64{"heard": stat(func(s pool.Stats) int64 { return s.Listener.Wakes }), "ignored": stat(func(s pool.Stats) int64 { return s.Listener.WakesIgnored }),
				"held": stat(func(s pool.Stats) int64 { return s.Listener.WakesHeld })}),
		counter("leash_claims_total", "Claim rounds, idle polls included.", stat(func(s pool.Stats) int64 { return s.Claims })),
		counter("leash_listener_pings_lost_total", "Listener liveness pings that did not come back in time.", stat(func(s pool.Stats) int64 { return s.Listener.PingsLost })),
		gauge("leash_listener_connected", "1 when the LISTEN connection is up.", func() float64 {
			if p.ListenerConnected() {
				return 1
			}
			return 0
		}),
		gauge("leash_notification_queue_usage", "Fraction of the server's notification queue in use, 0 to 1 (pg_notification_queue_usage); -1 when the database did not answer.", func() float64 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var u float64
			if err := db.QueryRow(ctx, `SELECT pg_notification_queue_usage()`).Scan(&u); err != nil {
				return -1
			}
			return u
		}),
		&pausedVec{desc: prometheus.NewDesc("leash_queue_paused",
			"1 for each of the worker's queues that is paused (leash.pause_queue), 0 for an active one, as of the worker's last read of leash.queues.",
			[]string{"queue"}, nil), p: p},
		&keyLimitVec{desc: prometheus.NewDesc("leash_jobs_waiting_on_key_limit",
			"Jobs due but not started because their concurrency key is at its queue's per-key limit, for each of the worker's queues with one; read at scrape time on at most 300 keys of each queue, each counted up to 1000 (pool.JobsWaitingOnKeyLimit: a lower bound beyond).",
			[]string{"queue"}, nil), p: p, db: db, read: pool.JobsWaitingOnKeyLimit},
		&keyLimitVec{desc: prometheus.NewDesc("leash_jobs_waiting_on_key_rate_limit",
			"Jobs due but not started because their concurrency key has no room under its queue's per-key rate limit, for each of the worker's queues with one; read at scrape time as leash_jobs_waiting_on_key_limit is (pool.JobsWaitingOnKeyRate).",
			[]string{"queue"}, nil), p: p, db: db, read: pool.JobsWaitingOnKeyRate},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
}

// funcVec is a counter family whose values are read from functions at scrape time.
type funcVec struct {
	desc   *prometheus.Desc
	values map[string]func() int64
}

func (f *funcVec) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }

func (f *funcVec) Collect(ch chan<- prometheus.Metric) {
	for label, v := range f.values {
		ch <- prometheus.MustNewConstMetric(f.desc, prometheus.CounterValue, float64(v()), label)
	}
}

// pausedVec reports leash_queue_paused for each of the pool's queues.
type pausedVec struct {
	desc *prometheus.Desc
	p    *pool.Pool
}

func (v *pausedVec) Describe(ch chan<- *prometheus.Desc) { ch <- v.desc }

func (v *pausedVec) Collect(ch chan<- prometheus.Metric) {
	for q, paused := range v.p.QueuesPaused() {
		val := 0.0
		if paused {
			val = 1
		}
		ch <- prometheus.MustNewConstMetric(v.desc, prometheus.GaugeValue, val, q)
	}
}

// keyLimitVec reports leash_jobs_waiting_on_key_limit (or _key_rate_limit) for each of the pool's
// queues that has a per-key limit (or per-key rate limit), read at scrape time (one bounded
// statement per such queue, on index entries only); nothing when the database does not answer.
type keyLimitVec struct {
	desc *prometheus.Desc
	p    *pool.Pool
	db   pool.DB
	read func(context.Context, pool.DB, []string) (map[string]int64, error)
}

func (v *keyLimitVec) Describe(ch chan<- *prometheus.Desc) { ch <- v.desc }

func (v *keyLimitVec) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	waiting, err := v.read(ctx, v.db, v.p.Config().Queues)
	if err != nil {
		return // the scrape goes on without it, as leash_notification_queue_usage reports -1
	}
	for q, n := range waiting {
		ch <- prometheus.MustNewConstMetric(v.desc, prometheus.GaugeValue, float64(n), q)
	}
}
