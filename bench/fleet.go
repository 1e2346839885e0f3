package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/leashq/leash/pool"
)

// The fleet scenario: many worker processes on one queue. Each pool is a process of its own
// (this binary re-executed as "child fleet"), with its own connections and listener, as a fleet
// of workers would be.

var (
	flagFleetHerd   = flag.Int("fleet-herd", 32, "fleet: waiting worker processes in the herd part")
	flagFleetRate   = flag.Int("fleet-rate", 20, "fleet: inserts per second in the herd part")
	flagFleetSecs   = flag.Int("fleet-secs", 10, "fleet: seconds of inserts in the herd part")
	flagFleetCurve  = flag.String("fleet-curve", "1,2,4,8,16,32", "fleet: worker processes at each point of the scaling curve")
	flagFleetSlots  = flag.Int("fleet-slots", 64, "fleet: total slots shared by the processes of a scaling point")
	flagFleetJobs   = flag.Int("fleet-jobs", 50000, "fleet: jobs burnt down at each scaling point")
	flagFleetIdle   = flag.Duration("fleet-idle", 30*time.Second, "fleet: how long the idle processes are watched")
	flagFleetRiver  = flag.Bool("fleet-river", true, "fleet: run River beside")
	flagFleetIdleN  = flag.Int("fleet-idle-procs", 32, "fleet: idle worker processes in the idle-cost part")
	flagFleetHerdPs = flag.Int("fleet-herd-slots", 4, "fleet: slots of each process in the herd and idle parts")
	flagFleetParts  = flag.String("fleet-parts", "herd,curve,idle", "fleet: the parts to run")
	flagFleetSettle = flag.Duration("fleet-settle", 11*time.Second, "fleet: wait before and after the herd's inserts, so that pg_stat_database has every backend's commits (idle backends report them within 10s)")
)

// fleetStats is what a leash child reports when it stops.
type fleetStats struct {
	Claims, Claimed, Wakes, WakesIgnored, WakesHeld, Received int64
}

// fleetProcs is a set of running worker processes; each leash one writes a line of its Stats as
// JSON to its stdout at SIGUSR1 and when it stops.
type fleetProcs struct {
	cmds  []*exec.Cmd
	lines []chan fleetStats
}

func startFleet(system, url string, procs, slots int) *fleetProcs {
	f := &fleetProcs{}
	for range procs {
		cmd := exec.Command(os.Args[0], "child", "fleet", system, url, strconv.Itoa(slots))
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			fail(err)
		}
		if err := cmd.Start(); err != nil {
			fail(err)
		}
		lines := make(chan fleetStats, 16)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				var s fleetStats
				if json.Unmarshal(sc.Bytes(), &s) == nil {
					lines <- s
				}
			}
			close(lines)
		}()
		f.cmds, f.lines = append(f.cmds, cmd), append(f.lines, lines)
	}
	return f
}

// collect reads one line from every leash process and sums them.
func (f *fleetProcs) collect() fleetStats {
	var sum fleetStats
	for _, ch := range f.lines {
		select {
		case s := <-ch:
			sum.Claims += s.Claims
			sum.Claimed += s.Claimed
			sum.Wakes += s.Wakes
			sum.WakesIgnored += s.WakesIgnored
			sum.WakesHeld += s.WakesHeld
			sum.Received += s.Received
		case <-time.After(10 * time.Second):
		}
	}
	return sum
}

// snapshot returns the sum of the leash processes' Stats now.
func (f *fleetProcs) snapshot() fleetStats {
	for _, c := range f.cmds {
		c.Process.Signal(syscall.SIGUSR1)
	}
	return f.collect()
}

// sub returns s - o.
func (s fleetStats) sub(o fleetStats) fleetStats {
	return fleetStats{Claims: s.Claims - o.Claims, Claimed: s.Claimed - o.Claimed, Wakes: s.Wakes - o.Wakes,
		WakesIgnored: s.WakesIgnored - o.WakesIgnored, WakesHeld: s.WakesHeld - o.WakesHeld, Received: s.Received - o.Received}
}

// stop stops every process and sums what the leash ones reported last.
func (f *fleetProcs) stop() fleetStats {
	for _, c := range f.cmds {
		c.Process.Signal(syscall.SIGTERM)
	}
	var sum fleetStats
	for _, ch := range f.lines {
		for s := range ch {
			sum = s.add(sum)
		}
	}
	for _, c := range f.cmds {
		c.Wait()
	}
	return sum
}

// add returns s + o.
func (s fleetStats) add(o fleetStats) fleetStats {
	return fleetStats{Claims: s.Claims + o.Claims, Claimed: s.Claimed + o.Claimed, Wakes: s.Wakes + o.Wakes,
		WakesIgnored: s.WakesIgnored + o.WakesIgnored, WakesHeld: s.WakesHeld + o.WakesHeld, Received: s.Received + o.Received}
}

// fleetChild runs one worker process until SIGTERM: "child fleet SYSTEM URL SLOTS". A leash child
// prints its Stats as JSON when it stops.
func fleetChild(system, url string, slots int) {
	ctx := context.Background()
	db := open(ctx, url, 10)
	sig := make(chan os.Signal, 1)
	signalNotify(sig)
	if system == "river" {
		c := newRiver(db, slots, riverTuned, nil)
		if err := c.Start(ctx); err != nil {
			fail(err)
		}
		<-sig
		stopRiver(c)
		return
	}
	p := newLeash(db, slots, nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	report := func() {
		s := p.Stats()
		json.NewEncoder(os.Stdout).Encode(fleetStats{Claims: s.Claims, Claimed: s.Claimed, Wakes: s.Listener.Wakes,
			WakesIgnored: s.Listener.WakesIgnored, WakesHeld: s.Listener.WakesHeld, Received: s.Listener.Received})
	}
	usr := make(chan os.Signal, 1)
	signal.Notify(usr, syscall.SIGUSR1)
	for {
		select {
		case <-usr:
			report()
			continue
		case <-sig:
		}
		break
	}
	p.Shutdown(context.Background())
	<-done
	report()
}

// commits is the database's committed transactions so far (pg_stat_database, which the
// statistics collector updates about once a second: callers wait before reading it).
func commits(ctx context.Context, db *pgxpool.Pool) int64 {
	var n int64
	if err := db.QueryRow(ctx, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").Scan(&n); err != nil {
		fail(err)
	}
	return n
}

// backends is how many connections other than db's own are open to db's database.
func backends(ctx context.Context, db *pgxpool.Pool) int {
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND backend_type = 'client backend'
		  AND application_name NOT LIKE 'bench-self%'`).Scan(&n); err != nil {
		fail(err)
	}
	return n
}

// openSelf opens the bench's own pool on url, named so that backends does not count it.
func openSelf(ctx context.Context, url string) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		fail(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = "bench-self"
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fail(err)
	}
	return db
}

// waitLeashWaiting waits until n leash processes wait for work and may be picked by an insert.
func waitLeashWaiting(ctx context.Context, db *pgxpool.Pool, n int) {
	waitAtLeast(ctx, db, 30*time.Second, "processes waiting", n, `SELECT count(DISTINCT waiter) FROM leash.waiters
		WHERE expires_at > now() AND wake_channel IS NOT NULL AND woken_at IS NULL`)
}

// waitAtLeast polls the count query until it reaches n, failing the bench after timeout.
func waitAtLeast(ctx context.Context, db *pgxpool.Pool, timeout time.Duration, what string, n int, query string) {
	deadline := time.Now().Add(timeout)
	for {
		var k int
		db.QueryRow(ctx, query).Scan(&k)
		if k >= n {
			return
		}
		if time.Now().After(deadline) {
			fail(fmt.Errorf("fleet: %d of %d %s after %s", k, n, what, timeout))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (b *bench) fleet(ctx context.Context) {
	parts := strings.Split(*flagFleetParts, ",")
	if slices.Contains(parts, "herd") {
		b.fleetHerd(ctx)
	}
	if slices.Contains(parts, "curve") {
		b.fleetCurve(ctx)
	}
	if slices.Contains(parts, "idle") {
		b.fleetIdle(ctx)
	}
}

// fleetHerd: a trickle of single inserts into a queue that procs idle processes wait on.
func (b *bench) fleetHerd(ctx context.Context) {
	rate, secs, herd := *flagFleetRate, *flagFleetSecs, *flagFleetHerd
	n := rate * secs
	scenario := fmt.Sprintf("fleet herd, %d inserts/s for %ds", rate, secs)
	logf("%s", scenario)
	systems := []string{"leash"}
	if *flagFleetRiver {
		systems = append(systems, "river")
	}
	for _, system := range systems {
		name := map[string]string{"river": "River tuned", "leash": "leash"}[system]
		for _, procs := range []int{1, herd} {
			url := b.freshDB(ctx)
			db := openSelf(ctx, url)
			f := startFleet(system, url, procs, *flagFleetHerdPs)
			var rc *river.Client[pgx.Tx]
			if system == "leash" {
				waitLeashWaiting(ctx, db, procs)
			} else {
				rc = newRiver(db, 1, riverTuned, nil) // an insert-only client
				time.Sleep(2 * time.Second)           // leader election, listeners
			}
			time.Sleep(*flagFleetSettle) // past start-up and its statistics
			c0 := commits(ctx, db)
			var s0 fleetStats
			if system == "leash" {
				s0 = f.snapshot()
			}
			tick := time.NewTicker(time.Second / time.Duration(rate))
			for range n {
				<-tick.C
				var err error
				if system == "leash" {
					_, err = pool.Insert(ctx, db, "noop", nil, nil)
				} else {
					_, err = rc.Insert(ctx, noopArgs{}, nil)
				}
				if err != nil {
					fail(err)
				}
			}
			tick.Stop()
			table := map[string]string{"river": "river_job", "leash": "leash.jobs"}[system]
			waitCompleted(ctx, db, table, n)
			var s fleetStats
			if system == "leash" {
				s = f.snapshot().sub(s0) // from the first insert to the last job's completion
			}
			time.Sleep(*flagFleetSettle)
			c1 := commits(ctx, db)
			f.stop()
			sys := fmt.Sprintf("%s × %d", name, procs)
			base := []string{fmt.Sprintf("%s × 1", name)}
			if procs == 1 {
				base = nil
			}
			lat := pickups(ctx, db, table)
			for _, p := range []float64{50, 99} {
				r := row{scenario: scenario, system: sys, metric: fmt.Sprintf("pickup p%g", p), value: ms(percentile(lat, p)), unit: "ms", baseline: base}
				if system == "leash" && procs > 1 && *flagFleetRiver {
					r.baseline = append(r.baseline, fmt.Sprintf("River tuned × %d", procs))
				}
				b.add(r)
			}
			// Inserts included (one commit each), and the fleet's idle commits over the window
			// (the inserts plus -fleet-settle).
			b.add(row{scenario: scenario, system: sys, metric: "commits/job", value: float64(c1-c0) / float64(n), unit: "", baseline: base})
			if system == "leash" {
				b.add(row{scenario: scenario, system: sys, metric: "claims/job", value: float64(s.Claims) / float64(n), unit: "", baseline: base})
				b.add(row{scenario: scenario, system: sys, metric: "wakes/job", value: float64(s.Wakes) / float64(n), unit: ""})
			}
			db.Close()
			b.dropDB(ctx, url)
		}
	}
}

func waitCompleted(ctx context.Context, db *pgxpool.Pool, table string, n int) {
	waitAtLeast(ctx, db, 5*time.Minute, "jobs completed", n, "SELECT count(*) FROM "+table+" WHERE state = 'completed'")
}

// fleetCurve: the same slots split over more and more processes, burning down jobs.
func (b *bench) fleetCurve(ctx context.Context) {
	n, total := *flagFleetJobs, *flagFleetSlots
	scenario := fmt.Sprintf("fleet scaling, %d slots, burn-down %d", total, n)
	logf("%s", scenario)
	var points []int
	for _, s := range strings.Split(*flagFleetCurve, ",") {
		if k, err := strconv.Atoi(strings.TrimSpace(s)); err == nil && k > 0 {
			points = append(points, k)
		}
	}
	systems := []string{"leash"}
	if *flagFleetRiver {
		systems = append(systems, "river")
	}
	for _, system := range systems {
		name := map[string]string{"river": "River tuned", "leash": "leash"}[system]
		var rows []row
		best := 0.0
		for _, procs := range points {
			url := b.freshDB(ctx)
			db := openSelf(ctx, url)
			// The processes start first and wait; the clock starts with the insert (one COPY for
			// leash, batches of 10000 for River), so that start-up is not counted.
			f := startFleet(system, url, procs, max(total/procs, 1))
			table := "leash.jobs"
			var began time.Time
			if system == "river" {
				table = "river_job"
				rc := newRiver(db, 1, riverTuned, nil)
				time.Sleep(2 * time.Second) // leader election, listeners
				began = time.Now()
				riverInsertNoops(ctx, rc, n)
			} else {
				waitLeashWaiting(ctx, db, procs)
				began = time.Now()
				leashInsertNoops(ctx, db, n)
			}
			conns := 0
			for {
				var done int
				db.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE state = 'completed'").Scan(&done)
				if done == n {
					break
				}
				if time.Since(began) > time.Second {
					conns = max(conns, backends(ctx, db))
				}
				time.Sleep(50 * time.Millisecond)
			}
			d := time.Since(began)
			f.stop()
			rate := float64(n) / d.Seconds()
			best = max(best, rate)
			sys := fmt.Sprintf("%s × %d", name, procs)
			rows = append(rows, row{scenario: scenario, system: sys, metric: "jobs/s", value: rate, unit: "jobs/s"})
			if conns > 0 {
				rows = append(rows, row{scenario: scenario, system: sys, metric: "conns/process, busy", value: float64(conns) / float64(procs), unit: ""})
			}
			db.Close()
			b.dropDB(ctx, url)
		}
		for _, r := range rows {
			if r.metric == "jobs/s" {
				// The ratio to the best point of the curve.
				r.baseline = []string{name + " best"}
			}
			b.add(r)
		}
		b.add(row{scenario: scenario, system: name + " best", metric: "jobs/s", value: best, unit: "jobs/s"})
	}
}

// fleetIdle: idle processes, watched for a while: what they cost the database.
func (b *bench) fleetIdle(ctx context.Context) {
	procs, d := *flagFleetIdleN, *flagFleetIdle
	scenario := fmt.Sprintf("fleet idle, %d processes for %s", procs, d)
	logf("%s", scenario)
	systems := []string{"leash"}
	if *flagFleetRiver {
		systems = append(systems, "river")
	}
	for _, system := range systems {
		name := map[string]string{"river": "River tuned", "leash": "leash"}[system]
		url := b.freshDB(ctx)
		db := openSelf(ctx, url)
		f := startFleet(system, url, procs, *flagFleetHerdPs)
		if system == "leash" {
			waitLeashWaiting(ctx, db, procs)
		}
		time.Sleep(3 * time.Second) // past start-up, leader election, a stats flush
		c0, t0 := commits(ctx, db), time.Now()
		conns := backends(ctx, db)
		time.Sleep(d)
		c1, el := commits(ctx, db), time.Since(t0)
		f.stop()
		sys := fmt.Sprintf("%s × %d", name, procs)
		var base []string
		if system == "river" {
			base = nil
		} else if *flagFleetRiver {
			base = []string{fmt.Sprintf("River tuned × %d", procs)}
		}
		b.add(row{scenario: scenario, system: sys, metric: "commits/s per process", value: float64(c1-c0) / el.Seconds() / float64(procs), unit: "/s", baseline: base})
		b.add(row{scenario: scenario, system: sys, metric: "conns/process, idle", value: float64(conns) / float64(procs), unit: "", baseline: base})
		db.Close()
		b.dropDB(ctx, url)
	}
}
