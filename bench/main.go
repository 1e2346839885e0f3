// Command bench measures leash against River side by side, on the same PostgreSQL in one run,
// and prints a table of ratios. With no DATABASE_URL it starts a private PostgreSQL from the local
// server binaries. Every scenario gets a fresh database holding both schemas.
//
//	cd bench && go run . [-jobs 50000] [-only burn,pickup,...]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/leashq/leash/internal/pgcluster"
	"github.com/leashq/leash/pool"
)

var (
	flagJobs  = flag.Int("jobs", 50000, "jobs in each burn-down")
	flagOnly  = flag.String("only", "", "comma-separated scenarios to run (burn,burn2000,capped,keys,rate,producers,steady,pickup,revoke,heartbeat,scale,memory,ablation,fleet,workflow (wfchain, wffanout: its parts); sustained, cpu, indexes and statements run only when named)")
	flagFsync = flag.Bool("fsync", true, "run the private cluster with durable commits (fsync on), as production databases run; false for the old, faster setting")
)

// bench holds the server every scenario runs against.
type bench struct {
	admin   string // connection string of a maintenance database
	counter atomic.Int64
	rows    []row
}

// row is one line of the results table.
type row struct {
	scenario, system, metric string
	value                    float64
	unit                     string
	baseline                 []string // the systems this row is compared with
	higherBetter             bool
	runs                     []float64 // every run, when value is their median
}

var flagRepeat = flag.Int("repeat", 3, "runs of each system in the burn-down, capped, ablation and producers scenarios, interleaved; the median is reported, with the spread")

// trial is one system of a scenario measured in several interleaved runs.
type trial struct {
	system       string
	baseline     []string
	higherBetter bool
	once         bool // slow and far from the others: one run is enough
	run          func() float64
}

// trials runs every trial -repeat times, round after round (so that a slow minute on a noisy
// machine hits all systems alike), and adds one row per trial with the median.
func (b *bench) trials(scenario, metric, unit string, ts []trial) {
	runs := make([][]float64, len(ts))
	for round := range max(*flagRepeat, 1) {
		for i, t := range ts {
			if t.once && round > 0 {
				continue
			}
			v := t.run()
			runs[i] = append(runs[i], v)
			logf("  %-28s %-22s %-18s %12.2f %s (run %d)", scenario, t.system, metric, v, unit, round+1)
		}
	}
	for i, t := range ts {
		b.add(row{scenario: scenario, system: t.system, metric: metric, value: median(runs[i]), unit: unit,
			baseline: t.baseline, higherBetter: t.higherBetter, runs: runs[i]})
	}
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	} else {
		return (s[n/2-1] + s[n/2]) / 2
	}
}

func main() {
	flag.Parse()
	if len(os.Args) > 1 && os.Args[1] == "child" {
		childMain(os.Args[2:])
		return
	}
	ctx := context.Background()
	b := &bench{admin: os.Getenv("DATABASE_URL")}
	if b.admin == "" {
		settings := []string{"max_connections = 3000", "shared_buffers = 512MB", "synchronous_commit = on"}
		if *flagFsync {
			settings = append(settings, "fsync = on", "full_page_writes = on")
		}
		c, err := pgcluster.Start(ctx, settings...)
		if err != nil {
			fail(err)
		}
		defer c.Close()
		b.admin = c.URL("postgres")
	}
	only := map[string]bool{}
	for _, s := range strings.Split(*flagOnly, ",") {
		if s != "" {
			only[s] = true
		}
	}
	run := func(name string, f func(context.Context)) {
		if len(only) == 0 || only[name] {
			f(ctx)
		}
	}
	run("burn", b.burnDown100)
	run("burn2000", b.burnDown2000)
	run("capped", b.queueCap)
	run("keys", b.keys)
	run("rate", b.rate)
	run("producers", b.producers)
	run("steady", b.steady)
	if only["sustained"] {
		b.sustained(ctx) // minutes long: only when asked for
	}
	if only["cpu"] {
		b.cpuPerJob(ctx) // a measurement of the hot path's cost: only when asked for
	}
	run("pickup", b.pickup)
	run("revoke", b.revocation)
	run("heartbeat", b.heartbeat)
	run("scale", b.scaleOut)
	run("memory", b.memory)
	run("ablation", b.ablation)
	run("fleet", b.fleet)
	run("workflow", b.workflows)
	if !only["workflow"] {
		run("wfchain", b.workflowChain) // parts of workflow, on their own
		run("wffanout", b.workflowFanOut)
	}
	if only["indexes"] {
		b.indexAblation(ctx) // the schema's ablations: only when asked for
	}
	if only["statements"] {
		b.statementCosts(ctx) // what checks and triggers cost a statement: only when asked for
	}
	b.print()
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}

func logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }

// freshDB creates a database with leash's and River's schemas and returns its URL.
func (b *bench) freshDB(ctx context.Context) string {
	name := fmt.Sprintf("bench_%d_%d", os.Getpid(), b.counter.Add(1))
	conn, err := pgx.Connect(ctx, b.admin)
	if err != nil {
		fail(err)
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		fail(err)
	}
	conn.Close(ctx)
	u := withDB(b.admin, name)
	db := open(ctx, u, 10)
	defer db.Close()
	if _, err := pool.Migrate(ctx, db); err != nil {
		fail(err)
	}
	m, err := rivermigrate.New(riverpgxv5.New(db), nil)
	if err != nil {
		fail(err)
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		fail(err)
	}
	return u
}

// dropDB drops the database of url, so that vacuuming what a long run left behind does not load
// the runs after it.
func (b *bench) dropDB(ctx context.Context, url string) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		fail(err)
	}
	conn, err := pgx.Connect(ctx, b.admin)
	if err != nil {
		fail(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{cfg.Database}.Sanitize()+" WITH (FORCE)"); err != nil {
		fail(err)
	}
}

func withDB(connString, db string) string {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		fail(err)
	}
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", cfg.User, cfg.Host, cfg.Port, db)
}

func open(ctx context.Context, url string, maxConns int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		fail(err)
	}
	cfg.MaxConns = maxConns
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fail(err)
	}
	return db
}

func (b *bench) add(r row) {
	b.rows = append(b.rows, r)
	logf("  %-28s %-22s %-18s %12.2f %s", r.scenario, r.system, r.metric, r.value, r.unit)
}

// print writes the machine, the versions and the table, each row with its ratio to the
// baseline measured in the same run.
func (b *bench) print() {
	fmt.Printf("machine: %s/%s, %d cores (GOMAXPROCS %d), %s\n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), cpuModel())
	fmt.Printf("versions: %s, PostgreSQL %s, %s\n", runtime.Version(), serverVersion(b.admin), moduleVersions())
	fmt.Println()
	fmt.Println("| scenario | system | metric | value | vs baseline |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range b.rows {
		var ratios []string
		for _, want := range r.baseline {
			for _, base := range b.rows {
				if base.scenario == r.scenario && base.metric == r.metric && base.system == want && base.value > 0 {
					ratios = append(ratios, fmt.Sprintf("%.2fx %s", r.value/base.value, want))
				}
			}
		}
		ratio := strings.Join(ratios, ", ")
		value := fmt.Sprintf("%.2f %s", r.value, r.unit)
		if len(r.runs) > 1 {
			value += fmt.Sprintf(" (median of %d: %.0f–%.0f)", len(r.runs), slices.Min(r.runs), slices.Max(r.runs))
		}
		fmt.Printf("| %s | %s | %s | %s | %s |\n", r.scenario, r.system, r.metric, value, ratio)
	}
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

func serverVersion(url string) string {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return "?"
	}
	defer conn.Close(ctx)
	var v string
	conn.QueryRow(ctx, "SHOW server_version").Scan(&v)
	return v
}

func moduleVersions() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var out []string
	for _, m := range info.Deps {
		switch m.Path {
		case "github.com/riverqueue/river", "github.com/jackc/pgx/v5":
			out = append(out, m.Path+" "+m.Version)
		}
	}
	slices.Sort(out)
	return "leash (this tree), " + strings.Join(out, ", ")
}

// percentile returns the p-th percentile (0..100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p / 100)
	return sorted[i]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
