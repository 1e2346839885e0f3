package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

var (
	flagCPUProfile = flag.String("cpuprofile", "", "cpu scenario: write a CPU profile of each leash burn-down to this file, suffixed with the run's number")
	flagMemProfile = flag.String("memprofile", "", "cpu scenario: write an allocation profile after each leash burn-down to this file, suffixed with the run's number")
	flagPerf       = flag.String("perf", "", "cpu scenario: record every burn-down machine-wide with `perf record -a -g` (PostgreSQL's processes included) into this file, suffixed with the system and the run's number")
)

// perfRecording is a machine-wide perf record running beside one burn-down.
type perfRecording struct{ cmd *exec.Cmd }

// startPerf starts perf record into -perf's file for the system's run; nil without -perf.
func startPerf(system string, run int) *perfRecording {
	if *flagPerf == "" {
		return nil
	}
	out := fmt.Sprintf("%s.%s.%d", *flagPerf, strings.ReplaceAll(system, " ", "-"), run)
	cmd := exec.Command("perf", "record", "-a", "-g", "-F", "499", "-q", "-o", out)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		fail(fmt.Errorf("perf record: %w", err))
	}
	time.Sleep(500 * time.Millisecond) // perf opens its events on every CPU before it samples
	return &perfRecording{cmd: cmd}
}

// stop ends the recording (perf writes its file on SIGINT) and waits for it.
func (r *perfRecording) stop() {
	if r == nil {
		return
	}
	if err := r.cmd.Process.Signal(os.Interrupt); err != nil {
		fail(fmt.Errorf("perf record: %w", err))
	}
	if err := r.cmd.Wait(); err != nil {
		logf("  perf record: %v", err)
	}
}

// cost is what one burn-down cost: the wall time, this process's CPU (the workers: claim loop,
// handlers, finisher, keeper, the pgx client), its heap allocations, and the CPU of every
// process of the PostgreSQL server (backends, WAL writer, checkpointer, autovacuum) when the
// server runs on this machine.
type cost struct {
	wall          time.Duration
	cpu           time.Duration
	allocs, bytes uint64
	server        time.Duration // -1 when the server's processes cannot be read
}

// costMeter takes the readings a cost is the difference of.
type costMeter struct {
	postmaster int
	began      time.Time
	cpu        time.Duration
	allocs     uint64
	bytes      uint64
	server     map[int]time.Duration
}

// startCost reads the counters before a burn-down on db.
func startCost(ctx context.Context, db *pgxpool.Pool) *costMeter {
	m := &costMeter{postmaster: postmasterPID(ctx, db)}
	m.server = serverCPU(m.postmaster)
	m.allocs, m.bytes = heapAllocs()
	m.cpu = processCPU()
	m.began = time.Now()
	return m
}

// stop reads the counters after the burn-down. A server process that started since counts from
// zero; one that ended since is not counted.
func (m *costMeter) stop() cost {
	c := cost{wall: time.Since(m.began), cpu: processCPU() - m.cpu, server: -1}
	a, b := heapAllocs()
	c.allocs, c.bytes = a-m.allocs, b-m.bytes
	if m.server != nil {
		if after := serverCPU(m.postmaster); after != nil {
			c.server = 0
			for pid, t := range after {
				c.server += t - m.server[pid]
			}
		}
	}
	return c
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		fail(fmt.Errorf("getrusage: %w", err))
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func heapAllocs() (objects, bytes uint64) {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}, {Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64(), s[1].Value.Uint64()
}

// postmasterPID is the pid of the server's postmaster (the parent of db's backend), or 0 when
// the server's processes are not visible here.
func postmasterPID(ctx context.Context, db *pgxpool.Pool) int {
	var backend int
	if err := db.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		fail(err)
	}
	st, err := readStat(backend)
	if err != nil {
		return 0
	}
	return st.ppid
}

// serverCPU is the CPU time of the postmaster's children by pid (user + system, from
// /proc/<pid>/stat, in clock ticks of 10 ms), nil when they cannot be read.
func serverCPU(postmaster int) map[int]time.Duration {
	if postmaster == 0 {
		return nil
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return nil
	}
	out := map[int]time.Duration{}
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		st, err := readStat(pid)
		if err != nil || (st.ppid != postmaster && pid != postmaster) {
			continue
		}
		out[pid] = st.cpu
	}
	return out
}

type procStat struct {
	ppid int
	cpu  time.Duration
}

// clockTick is USER_HZ, the unit of /proc/<pid>/stat's times: 100 on Linux.
const clockTick = 10 * time.Millisecond

func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	// The command (field 2) is in parentheses and may hold spaces: fields count from its end.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state)
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	ppid, _ := strconv.Atoi(f[1])               // field 4
	utime, _ := strconv.ParseInt(f[11], 10, 64) // field 14
	stime, _ := strconv.ParseInt(f[12], 10, 64) // field 15
	return procStat{ppid: ppid, cpu: time.Duration(utime+stime) * clockTick}, nil
}

// cpuPerJob: the CPU and allocations per job of a burn-down of -jobs jobs at 100 slots, leash
// against the minimal queue, in interleaved runs. The process's CPU is the workers' (the bench
// does nothing else meanwhile); the server's is every process of the PostgreSQL server.
func (b *bench) cpuPerJob(ctx context.Context) {
	n := *flagJobs
	scenario := fmt.Sprintf("cost per job, burn-down %d, 100 workers", n)
	logf("%s", scenario)
	type series struct {
		name string
		run  func(run int) cost
	}
	all := []series{
		{minimal, func(run int) cost { return b.minimalCost(ctx, n, run, false) }},
		{minimalConcurrent, func(run int) cost { return b.minimalCost(ctx, n, run, true) }},
		{"leash", func(run int) cost { return b.leashCost(ctx, n, run) }},
	}
	costs := make([][]cost, len(all))
	for round := range max(*flagRepeat, 1) {
		for i, s := range all {
			c := s.run(round + 1)
			costs[i] = append(costs[i], c)
			logf("  %-22s run %d: %8.0f jobs/s, worker %6.1f µs/job, %6.1f allocs/job, %7.0f B/job, server %6.1f µs/job",
				s.name, round+1, float64(n)/c.wall.Seconds(), perJob(c.cpu, n), float64(c.allocs)/float64(n),
				float64(c.bytes)/float64(n), perJob(c.server, n))
		}
	}
	for i, s := range all {
		var rate, cpu, allocs, bytes, server []float64
		for _, c := range costs[i] {
			rate = append(rate, float64(n)/c.wall.Seconds())
			cpu = append(cpu, perJob(c.cpu, n))
			allocs = append(allocs, float64(c.allocs)/float64(n))
			bytes = append(bytes, float64(c.bytes)/float64(n))
			server = append(server, perJob(c.server, n))
		}
		var base []string
		switch s.name {
		case minimal:
		case minimalConcurrent:
			base = []string{minimal}
		default:
			base = []string{minimal, minimalConcurrent}
		}
		add := func(metric string, v []float64, unit string, higherBetter bool) {
			b.add(row{scenario: scenario, system: s.name, metric: metric, value: median(v), unit: unit,
				baseline: base, higherBetter: higherBetter, runs: v})
		}
		add("jobs/s", rate, "jobs/s", true)
		add("worker CPU per job", cpu, "µs", false)
		add("allocations per job", allocs, "allocs", false)
		add("bytes allocated per job", bytes, "B", false)
		if server[0] >= 0 {
			add("server CPU per job", server, "µs", false)
		}
	}
}

func perJob(d time.Duration, n int) float64 {
	if d < 0 {
		return -1
	}
	return float64(d.Microseconds()) / float64(n)
}

// minimalCost is minimalQueue (concurrent: minimalQueueConcurrent), measured.
func (b *bench) minimalCost(ctx context.Context, n, run int, concurrent bool) cost {
	db := b.minimalDB(ctx, n)
	defer db.Close()
	system := minimal
	if concurrent {
		system = minimalConcurrent
	}
	rec := startPerf(system, run)
	m := startCost(ctx, db)
	if concurrent {
		minimalConcurrentDrain(ctx, db, n, 2, 100)
	} else {
		minimalDrain(ctx, db, n, 2)
	}
	c := m.stop()
	rec.stop()
	return c
}

// leashCost is leashBurn at 100 slots, measured (and profiled with -cpuprofile, -memprofile).
func (b *bench) leashCost(ctx context.Context, n, run int) cost {
	db := open(ctx, b.freshDB(ctx), 10)
	defer db.Close()
	leashInsertNoops(ctx, db, n)
	cnt := newCounter(n)
	p := newLeashConfig(db, pool.Config{Concurrency: 100, Observer: cnt})
	if *flagCPUProfile != "" {
		f, err := os.Create(fmt.Sprintf("%s.%d", *flagCPUProfile, run))
		if err != nil {
			fail(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fail(err)
		}
		defer pprof.StopCPUProfile()
	}
	rec := startPerf("leash", run)
	m := startCost(ctx, db)
	go p.Run(ctx)
	<-cnt.done
	c := m.stop()
	rec.stop()
	p.Shutdown(context.Background())
	if *flagMemProfile != "" {
		f, err := os.Create(fmt.Sprintf("%s.%d", *flagMemProfile, run))
		if err != nil {
			fail(err)
		}
		defer f.Close()
		if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
			fail(err)
		}
	}
	return c
}
