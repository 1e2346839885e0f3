package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/leashq/leash/pool"
)

// floor is leash's own claim and outcome statements run one after the other by one client:
// how well leash overlaps its statements, not what PostgreSQL can do (see minimal).
const floor = "leash statements, serial"

// minimal is the minimal queue (see minimalQueue): the floor leash is measured against.
const minimal = "minimal queue"

func (b *bench) burnDown100(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("burn-down %d, 100 workers", n)
	logf("%s", scenario)
	ts := []trial{{system: minimal, higherBetter: true, run: func() float64 {
		return b.minimalQueue(ctx, n)
	}}, {system: minimalConcurrent, baseline: []string{minimal}, higherBetter: true, run: func() float64 {
		return b.minimalQueueConcurrent(ctx, n)
	}}, {system: floor, baseline: []string{minimal}, higherBetter: true, run: func() float64 {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		leashInsertNoops(ctx, db, n)
		return float64(n) / rawFloor(ctx, db, n).Seconds()
	}}}
	for _, t := range []riverTuning{riverDefaults, riverTuned} {
		ts = append(ts, trial{system: t.String(), baseline: []string{minimal}, once: t == riverDefaults, run: func() float64 {
			return b.riverBurn(ctx, n, 100, t)
		}})
	}
	ts = append(ts, trial{system: "leash", baseline: []string{"River tuned", minimal, minimalConcurrent, floor}, run: func() float64 {
		return b.leashBurn(ctx, n, pool.Config{Concurrency: 100})
	}})
	b.trials(scenario, "jobs/s", "jobs/s", ts)
}

func (b *bench) burnDown2000(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("burn-down %d, 2000 workers", n)
	logf("%s", scenario)
	b.trials(scenario, "jobs/s", "jobs/s", []trial{
		{system: "River tuned", run: func() float64 { return b.riverBurn(ctx, n, 2000, riverTuned) }},
		{system: "leash", baseline: []string{"River tuned"}, run: func() float64 {
			return b.leashBurn(ctx, n, pool.Config{Concurrency: 2000})
		}},
	})
}

// riverBurn drains n no-op jobs with River on a fresh database and returns jobs/s.
func (b *bench) riverBurn(ctx context.Context, n, workers int, t riverTuning) float64 {
	db := open(ctx, b.freshDB(ctx), int32(max(20, workers/50)))
	defer db.Close()
	c := newRiver(db, workers, t, nil)
	riverInsertNoops(ctx, c, n)
	return float64(n) / riverDrain(ctx, c, n).Seconds()
}

// leashBurn drains n no-op jobs with a leash pool of cfg on a fresh database and returns jobs/s.
func (b *bench) leashBurn(ctx context.Context, n int, cfg pool.Config) float64 {
	db := open(ctx, b.freshDB(ctx), 10)
	defer db.Close()
	leashInsertNoops(ctx, db, n)
	cnt := newCounter(n)
	cfg.Observer = cnt
	return float64(n) / leashDrain(ctx, newLeashConfig(db, cfg), cnt).Seconds()
}

// pickupSQL reads attempted_at - created_at of every job from the database clock.
func pickups(ctx context.Context, db *pgxpool.Pool, table string) []time.Duration {
	rows, err := db.Query(ctx, "SELECT attempted_at - created_at FROM "+table+" WHERE attempted_at IS NOT NULL")
	if err != nil {
		fail(err)
	}
	defer rows.Close()
	var out []time.Duration
	for rows.Next() {
		var d time.Duration
		rows.Scan(&d)
		out = append(out, d)
	}
	slices.Sort(out)
	return out
}

func (b *bench) addLatencies(scenario, system, baseline string, lat []time.Duration, pcts ...float64) {
	slices.Sort(lat)
	for _, p := range pcts {
		r := row{scenario: scenario, system: system, metric: fmt.Sprintf("p%g", p), value: ms(percentile(lat, p)), unit: "ms"}
		if baseline != "" {
			r.baseline = []string{baseline}
		}
		b.add(r)
	}
}

// pickup: single committed inserts with small random gaps into an idle system.
func (b *bench) pickup(ctx context.Context) {
	const n = 300
	scenario := "pickup latency, idle"
	logf("%s", scenario)
	gaps := make([]time.Duration, n)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range gaps {
		gaps[i] = time.Duration(5+rng.IntN(20)) * time.Millisecond
	}
	for _, t := range []riverTuning{riverDefaults, riverTuned} {
		db := open(ctx, b.freshDB(ctx), 20)
		c := newRiver(db, 100, t, nil)
		events, cancel := c.Subscribe(river.EventKindJobCompleted)
		c.Start(ctx)
		time.Sleep(500 * time.Millisecond) // let it settle (leader election, listener)
		for i := range n {
			if _, err := c.Insert(ctx, noopArgs{}, nil); err != nil {
				fail(err)
			}
			time.Sleep(gaps[i])
		}
		for range n {
			<-events
		}
		cancel()
		stopRiver(c)
		b.addLatencies(scenario, t.String(), "", pickups(ctx, db, "river_job"), 50, 90, 99)
		db.Close()
	}
	db := open(ctx, b.freshDB(ctx), 10)
	cnt := newCounter(n)
	// Also measured on the worker's clock from the moment the insert's commit returned: the
	// database-clock pickup above includes the insert's own commit (created_at is its start).
	startedAt := make(chan time.Time, n)
	p := newLeash(db, 100, cnt, map[string]pool.Handler{"pick": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		startedAt <- time.Now()
		return nil
	})})
	go p.Run(ctx)
	time.Sleep(500 * time.Millisecond)
	afterCommit := make([]time.Duration, 0, n)
	for i := range n {
		if _, err := pool.Insert(ctx, db, "pick", nil, nil); err != nil {
			fail(err)
		}
		committed := time.Now()
		select {
		case at := <-startedAt:
			afterCommit = append(afterCommit, max(at.Sub(committed), 0))
		case <-time.After(10 * time.Second):
			fail(fmt.Errorf("pickup: job %d did not start", i))
		}
		time.Sleep(gaps[i])
	}
	<-cnt.done
	p.Shutdown(ctx)
	b.addLatencies(scenario, "leash", "River tuned", pickups(ctx, db, "leash.jobs"), 50, 90, 99)
	b.addLatencies(scenario, "leash, from the insert's commit", "", afterCommit, 50, 90, 99)
	db.Close()
}

// revocation: from the cancel request to the handler seeing its context cancelled.
func (b *bench) revocation(ctx context.Context) {
	const n = 100
	scenario := "revocation to handler cancelled"
	logf("%s", scenario)
	{
		db := open(ctx, b.freshDB(ctx), 20)
		sw := &sleepWorker{started: make(chan int64, 1), cancelled: make(chan time.Time, 1)}
		c := newRiver(db, 100, riverTuned, sw)
		c.Start(ctx)
		var lat []time.Duration
		for range n {
			if _, err := c.Insert(ctx, sleepArgs{MS: 600000}, nil); err != nil {
				fail(err)
			}
			id := <-sw.started
			sent := time.Now()
			if _, err := c.JobCancel(ctx, id); err != nil {
				fail(err)
			}
			lat = append(lat, (<-sw.cancelled).Sub(sent))
		}
		stopRiver(c)
		b.addLatencies(scenario, "River tuned (JobCancel)", "", lat, 50, 99)
		db.Close()
	}
	db := open(ctx, b.freshDB(ctx), 10)
	started, cancelled := make(chan int64, 1), make(chan time.Time, 1)
	p := newLeash(db, 100, nil, map[string]pool.Handler{"sleep": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started <- j.ID
		<-ctx.Done()
		cancelled <- time.Now()
		return context.Cause(ctx)
	})})
	go p.Run(ctx)
	for !p.ListenerConnected() {
		time.Sleep(5 * time.Millisecond)
	}
	var lat []time.Duration
	for range n {
		if _, err := pool.Insert(ctx, db, "sleep", nil, nil); err != nil {
			fail(err)
		}
		id := <-started
		sent := time.Now()
		if _, err := db.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", id)); err != nil {
			fail(err)
		}
		lat = append(lat, (<-cancelled).Sub(sent))
	}
	p.Shutdown(ctx)
	b.addLatencies(scenario, "leash (NOTIFY)", "River tuned (JobCancel)", lat, 50, 99)
	db.Close()
}

// heartbeat: throughput of short jobs while 1000 long jobs hold leases, against the same pool
// with no long jobs.
func (b *bench) heartbeat(ctx context.Context) {
	n := *flagJobs / 2
	scenario := fmt.Sprintf("%d short jobs beside 1000 leases", n)
	logf("%s", scenario)
	run := func(long int) float64 {
		db := open(ctx, b.freshDB(ctx), 10)
		defer db.Close()
		var holding atomic.Int64
		release := make(chan struct{})
		cnt := newCounter(n + long)
		p := newLeash(db, 100+long, cnt, map[string]pool.Handler{"hold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			holding.Add(1)
			<-release
			return nil
		})})
		holds := make([]pool.InsertManyParams, long)
		for i := range holds {
			holds[i] = pool.InsertManyParams{Kind: "hold", Opts: &pool.InsertOpts{Priority: -1}}
		}
		if long > 0 {
			pool.InsertMany(ctx, db, holds)
		}
		go p.Run(ctx)
		for holding.Load() < int64(long) {
			time.Sleep(5 * time.Millisecond)
		}
		began := time.Now()
		leashInsertNoops(ctx, db, n)
		for atomic.LoadInt64(&cnt.n) < int64(n) {
			time.Sleep(time.Millisecond)
		}
		d := time.Since(began)
		close(release)
		<-cnt.done
		p.Shutdown(ctx)
		return float64(n) / d.Seconds()
	}
	base := run(0)
	b.add(row{scenario: scenario, system: "leash, no long jobs", metric: "jobs/s", value: base, unit: "jobs/s"})
	b.add(row{scenario: scenario, system: "leash, 1000 leases held", metric: "jobs/s", value: run(1000), unit: "jobs/s", baseline: []string{"leash, no long jobs"}})
}

// steady: a producer inserts continuously while workers drain; completed/s and pickup latency.
func (b *bench) steady(ctx context.Context) {
	const rate, secs = 5000, 10 // jobs/s offered, for this long
	scenario := fmt.Sprintf("steady %d jobs/s offered for %ds", rate, secs)
	logf("%s", scenario)
	// produce inserts a batch every 10 ms for secs seconds and returns how many it inserted.
	produce := func(insert func() int) int {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		n := 0
		for end := time.Now().Add(secs * time.Second); time.Now().Before(end); <-tick.C {
			n += insert()
		}
		return n
	}
	{
		db := open(ctx, b.freshDB(ctx), 20)
		c := newRiver(db, 100, riverTuned, nil)
		events, cancel := c.SubscribeConfig(&river.SubscribeConfig{ChanSize: 2 * rate * secs, Kinds: []river.EventKind{river.EventKindJobCompleted}})
		c.Start(ctx)
		began := time.Now()
		params := make([]river.InsertManyParams, rate/100)
		for i := range params {
			params[i] = river.InsertManyParams{Args: noopArgs{}}
		}
		total := produce(func() int {
			res, err := c.InsertMany(ctx, params)
			if err != nil {
				fail(err)
			}
			return len(res)
		})
		for range total {
			<-events
		}
		d := time.Since(began)
		cancel()
		stopRiver(c)
		b.add(row{scenario: scenario, system: "River tuned", metric: "completed/s", value: float64(total) / d.Seconds(), unit: "jobs/s"})
		b.addLatencies(scenario, "River tuned", "", pickups(ctx, db, "river_job"), 50, 99)
		db.Close()
	}
	db := open(ctx, b.freshDB(ctx), 10)
	var finished atomic.Int64
	p := newLeash(db, 100, observerFunc(func() { finished.Add(1) }), nil)
	go p.Run(ctx)
	began := time.Now()
	params := make([]pool.InsertManyParams, rate/100)
	for i := range params {
		params[i].Kind = "noop"
	}
	total := produce(func() int {
		n, err := pool.InsertMany(ctx, db, params)
		if err != nil {
			fail(err)
		}
		return int(n)
	})
	for finished.Load() < int64(total) {
		time.Sleep(time.Millisecond)
	}
	d := time.Since(began)
	p.Shutdown(ctx)
	b.add(row{scenario: scenario, system: "leash", metric: "completed/s", value: float64(total) / d.Seconds(), unit: "jobs/s", baseline: []string{"River tuned"}})
	b.addLatencies(scenario, "leash", "River tuned", pickups(ctx, db, "leash.jobs"), 50, 99)
	db.Close()
}

// observerFunc adapts a function to pool.Observer.
type observerFunc func()

func (f observerFunc) JobFinished(pool.JobEvent) { f() }

// scaleOut: the same burn-down with 1, 2 and 4 worker processes (100 slots each).
func (b *bench) scaleOut(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("scale-out, burn-down %d", n)
	logf("%s", scenario)
	for _, system := range []string{"river", "leash"} {
		for _, procs := range []int{1, 2, 4} {
			url := b.freshDB(ctx)
			db := open(ctx, url, 10)
			table := "leash.jobs"
			if system == "river" {
				table = "river_job"
				riverInsertNoops(ctx, newRiver(db, 1, riverTuned, nil), n)
			} else {
				leashInsertNoops(ctx, db, n)
			}
			began := time.Now()
			var cmds []*exec.Cmd
			for range procs {
				cmds = append(cmds, child("scale", system, url))
			}
			for {
				var done int
				db.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE state = 'completed'").Scan(&done)
				if done == n {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			d := time.Since(began)
			for _, c := range cmds {
				c.Process.Signal(syscall.SIGTERM)
				c.Wait()
			}
			name := map[string]string{"river": "River tuned", "leash": "leash"}[system]
			rate := float64(n) / d.Seconds()
			r := row{scenario: scenario, system: fmt.Sprintf("%s × %d", name, procs), metric: "jobs/s", value: rate, unit: "jobs/s"}
			if procs > 1 {
				r.baseline = []string{fmt.Sprintf("%s × 1", name)}
			}
			b.add(r)
			db.Close()
		}
	}
}

// memory: resident set size of a worker process holding 1000 sleeping jobs.
func (b *bench) memory(ctx context.Context) {
	scenario := "RSS with 1000 sleeping jobs"
	logf("%s", scenario)
	for _, system := range []string{"river", "leash"} {
		url := b.freshDB(ctx)
		cmd := exec.Command(os.Args[0], "child", "memory", system, url)
		cmd.Stderr = os.Stderr
		out, err := cmd.Output()
		if err != nil {
			fail(fmt.Errorf("memory child: %w", err))
		}
		kb, _ := strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
		name := map[string]string{"river": "River tuned", "leash": "leash"}[system]
		r := row{scenario: scenario, system: name, metric: "RSS", value: kb / 1024, unit: "MB"}
		if system == "leash" {
			r.baseline = []string{"River tuned"}
		}
		b.add(r)
	}
}

func child(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], append([]string{"child"}, args...)...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		fail(err)
	}
	return cmd
}

// childMain runs in a child process: "scale SYSTEM URL" works until SIGTERM; "memory SYSTEM URL"
// holds 1000 sleeping jobs and prints its RSS in kB.
func childMain(args []string) {
	ctx := context.Background()
	what, system, url := args[0], args[1], args[2]
	if what == "fleet" {
		slots, err := strconv.Atoi(args[3])
		if err != nil {
			fail(err)
		}
		fleetChild(system, url, slots)
		return
	}
	db := open(ctx, url, 20)
	slots := 100
	if what == "memory" {
		slots = 1000
	}
	var running atomic.Int64
	sleep := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		running.Add(1)
		<-ctx.Done()
		return context.Cause(ctx)
	})
	var stop func()
	if system == "river" {
		sw := &sleepWorker{started: make(chan int64, 2000)}
		c := newRiver(db, slots, riverTuned, sw)
		if what == "memory" {
			params := make([]river.InsertManyParams, slots)
			for i := range params {
				params[i] = river.InsertManyParams{Args: sleepArgs{MS: 600000}}
			}
			c.InsertManyFast(ctx, params)
			go func() {
				for range sw.started {
					running.Add(1)
				}
			}()
		}
		c.Start(ctx)
		stop = func() { c.StopAndCancel(context.Background()) }
	} else {
		p := newLeash(db, slots, nil, map[string]pool.Handler{"sleep": sleep})
		if what == "memory" {
			params := make([]pool.InsertManyParams, slots)
			for i := range params {
				params[i].Kind = "sleep"
			}
			pool.InsertMany(ctx, db, params)
		}
		go p.Run(ctx)
		stop = func() {
			sctx, cancel := context.WithCancel(context.Background())
			cancel()
			p.Shutdown(sctx)
		}
	}
	if what == "memory" {
		for running.Load() < int64(slots) {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(2 * time.Second) // a few heartbeats' worth of steady state
		fmt.Println(rssKB())
		stop()
		return
	}
	sig := make(chan os.Signal, 1)
	signalNotify(sig)
	<-sig
	stop()
}

func rssKB() string {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB"))
		}
	}
	return "0"
}

// ablation: what leash's batching buys, measured by turning it down.
func (b *bench) ablation(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("ablation, burn-down %d, 100 workers", n)
	logf("%s", scenario)
	var ts []trial
	for _, c := range []struct {
		name string
		cfg  pool.Config
	}{
		{"leash defaults", pool.Config{}},
		{"leash, claims not gathered", pool.Config{Engine: pool.EngineConfig{ClaimGather: -1}}},
		{"leash, two claims in flight", pool.Config{Engine: pool.EngineConfig{ClaimsInFlight: 2}}},
		{"leash, every claim from the front", pool.Config{Engine: pool.EngineConfig{ClaimFromFront: true}}},
		{"leash, outcomes with the next claim", pool.Config{Engine: pool.EngineConfig{OutcomesWithClaims: true}}},
		{"leash, outcomes not gathered (1µs window)", pool.Config{Engine: pool.EngineConfig{FinishFlushInterval: time.Microsecond}}},
		{"leash, 10 slots", pool.Config{Concurrency: 10}},
	} {
		cfg := c.cfg
		cfg.Concurrency = cmpOr(cfg.Concurrency, 100)
		t := trial{system: c.name, run: func() float64 { return b.leashBurn(ctx, n, cfg) }}
		if c.name != "leash defaults" {
			t.baseline = []string{"leash defaults"}
		}
		ts = append(ts, t)
	}
	b.trials(scenario, "jobs/s", "jobs/s", ts)
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}
