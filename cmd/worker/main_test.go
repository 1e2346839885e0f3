package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/syncbuf"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func envOf(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

func runCmd(t *testing.T, getenv func(string) string, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), args, getenv, &out, &errOut)
	return out.String(), err
}

func TestBadConfigNamesTheVariable(t *testing.T) {
	t.Parallel()
	cases := map[string][]string{
		"WORKER_CONCURRENCY":            {"WORKER_CONCURRENCY", "lots"},
		"WORKER_LEASE_DURATION":         {"WORKER_LEASE_DURATION", "soon"},
		"WORKER_HEARTBEAT_INTERVAL":     {"WORKER_LEASE_DURATION", "10s", "WORKER_HEARTBEAT_INTERVAL", "6s"},
		"WORKER_POLL_INTERVAL":          {"WORKER_POLL_INTERVAL", "1ns"},
		"LOG_LEVEL":                     {"LOG_LEVEL", "loud"},
		"LOG_FORMAT":                    {"LOG_FORMAT", "xml"},
		"WORKER_DB_MAX_CONNS":           {"WORKER_DB_MAX_CONNS", "0"},
		"WORKER_CONTROL_CONNS":          {"WORKER_CONTROL_CONNS", "1"},
		"WORKER_PLANNER_STATS_INTERVAL": {"WORKER_PLANNER_STATS_INTERVAL", "1ms"},
		"WORKER_EXEC_ENV_ALLOW":         {"WORKER_EXEC_ENV_ALLOW", "A*B"},
		"WORKER_JOB_TIMEOUTS":           {"WORKER_JOB_TIMEOUTS", "http:-1s"},
		"WORKER_JOB_TIMEOUTS=parse":     {"WORKER_JOB_TIMEOUTS", "http:soon"},
		"WORKER_REVOKE_REQUIRE_ROW":     {"WORKER_REVOKE_REQUIRE_ROW", "maybe"},
		"WORKER_ADMIN_HOSTS":            {"WORKER_ADMIN_HOSTS", "ok.example,http://worker:8080"},
		"WORKER_WEBHOOK_ALLOW":          {"WORKER_WEBHOOK_ALLOW", "10.0.0.0/8,internal.example"},
		"WORKER_WEBHOOK_BLOCK_PRIVATE":  {"WORKER_WEBHOOK_BLOCK_PRIVATE", "maybe"},
		"DATABASE_URL":                  {},
		"WORKER_CONCURRENCY=0":          {"DATABASE_URL", "postgres://x@127.0.0.1:1/x", "WORKER_CONCURRENCY", "-5"},
	}
	for want, kv := range cases {
		_, err := runCmd(t, envOf(kv...), "status")
		name, _, _ := strings.Cut(want, "=")
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: error %v does not name it", want, err)
		}
	}
}

func TestDatabaseDownAtStart(t *testing.T) {
	t.Parallel()
	_, err := runCmd(t, envOf("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"), "run")
	if err == nil || !strings.Contains(err.Error(), "cannot reach the database at 127.0.0.1:1") {
		t.Fatalf("got %v", err)
	}
}

func TestCommands(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	env := envOf("DATABASE_URL", url)
	if out, err := runCmd(t, env, "migrate"); err != nil || !strings.Contains(out, "applied 1 001_jobs\napplied 2 ") {
		t.Fatalf("migrate: %q, %v", out, err)
	}
	if out, err := runCmd(t, env, "migrate"); err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("migrate again: %q, %v", out, err)
	}
	out, err := runCmd(t, env, "enqueue", "-kind", "sleep", "-payload", `{"duration":"1s"}`, "-queue", "q1", "-priority", "3", "-delay", "1h", "-max-attempts", "4")
	if err != nil {
		t.Fatal(err)
	}
	id, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil || id <= 0 {
		t.Fatalf("enqueue printed %q", out)
	}
	db := pgtest.PoolFor(t, url)
	var queue string
	var prio, maxAttempts int
	var delayed bool
	db.QueryRow(context.Background(), "SELECT queue, priority, max_attempts, run_at > now() + interval '59 minutes' FROM leash.jobs WHERE id = $1", id).
		Scan(&queue, &prio, &maxAttempts, &delayed)
	if queue != "q1" || prio != 3 || maxAttempts != 4 || !delayed {
		t.Fatalf("row: %s %d %d %v", queue, prio, maxAttempts, delayed)
	}
	for _, bad := range [][]string{{"enqueue"}, {"enqueue", "-kind", "x", "-payload", "{nope"}, {"enqueue", "-kind", "x", "-priority", "99999"}} {
		if _, err := runCmd(t, env, bad...); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	out, err = runCmd(t, env, "status")
	if err != nil || !strings.Contains(out, "q1") || !strings.Contains(out, "available") || !strings.Contains(out, "no job running") {
		t.Fatalf("status: %q, %v", out, err)
	}
	if out, err := runCmd(t, env, "revoke", strconv.FormatInt(id, 10), "-reason", "test"); err != nil || !strings.Contains(out, "revoked") {
		t.Fatalf("revoke: %q, %v", out, err)
	}
	if _, err := runCmd(t, env, "revoke", strconv.FormatInt(id, 10)); err == nil || !strings.Contains(err.Error(), "already finished") {
		t.Fatalf("second revoke: %v", err)
	}
	if _, err := runCmd(t, env, "frobnicate"); err == nil {
		t.Fatal("unknown command accepted")
	}
}

// buildWorker compiles the binary once per test that needs a real process.
func buildWorker(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "worker")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	return bin
}

func TestSIGTERMHandsBackAndExitsZero(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	var id int64
	db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"1m"}') RETURNING id`).Scan(&id)
	db.Exec(ctx, `INSERT INTO leash.jobs (kind) SELECT 'noop' FROM generate_series(1, 500)`)
	bin := buildWorker(t)
	cmd := exec.Command(bin, "run")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "WORKER_SHUTDOWN_TIMEOUT=1s", "LOG_FORMAT=json", "WORKER_POLL_INTERVAL=50ms")
	var logs bytes.Buffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		var done int
		var running bool
		db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed'), bool_or(state = 'running') FROM leash.jobs`).Scan(&done, &running)
		if done == 500 && running {
			break
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			t.Fatalf("500 noop jobs did not drain (%d done)\n%s", done, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The worker has sampled the admin charts' last hour (filled in at its start).
	poll(t, 20*time.Second, "the last hour's minutes sampled", func() bool {
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.minute_stats`).Scan(&n)
		return n >= 60
	})
	sent := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	err := cmd.Wait()
	if err != nil {
		t.Fatalf("exit: %v\n%s", err, logs.String())
	}
	if d := time.Since(sent); d > 10*time.Second {
		t.Fatalf("took %s to stop with a 1s shutdown timeout", d)
	}
	var state string
	var attempt int
	db.QueryRow(ctx, `SELECT state, attempt FROM leash.jobs WHERE id = $1`, id).Scan(&state, &attempt)
	if state != "available" || attempt != 0 {
		t.Fatalf("sleep job %s at attempt %d after shutdown", state, attempt)
	}
}

// startWorker starts the binary with env added to the test's environment; it is killed when the
// test ends.
func startWorker(t *testing.T, bin string, logs *syncbuf.Buffer, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, "run")
	cmd.Env = append(append(os.Environ(), "LOG_FORMAT=json"), env...)
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGCONT); cmd.Process.Kill(); cmd.Wait() })
	return cmd
}

// poll waits for a database condition that no signal reports (another process's progress).
func poll(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A worker frozen with SIGSTOP past its lease is taken over by another with a new token; once
// thawed it stays up, writes nothing, and the job completes once, at attempt 2.
func TestSIGSTOPTakeover(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	bin := buildWorker(t)
	timing := []string{"DATABASE_URL=" + url, "WORKER_LEASE_DURATION=2s", "WORKER_HEARTBEAT_INTERVAL=500ms", "WORKER_POLL_INTERVAL=100ms"}
	var logsA, logsB syncbuf.Buffer
	a := startWorker(t, bin, &logsA, append(timing, "WORKER_ID=A")...)
	var id, tokenA int64
	db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"3s"}') RETURNING id`).Scan(&id)
	poll(t, 20*time.Second, "A to claim the job", func() bool {
		var holder *string
		db.QueryRow(ctx, `SELECT leased_by, lease_token FROM leash.jobs WHERE id = $1`, id).Scan(&holder, &tokenA)
		return holder != nil && *holder == "A"
	})
	a.Process.Signal(syscall.SIGSTOP)
	stopped := time.Now()
	startWorker(t, bin, &logsB, append(timing, "WORKER_ID=B")...)
	var tokenB int64
	poll(t, 20*time.Second, "B to take the job over", func() bool {
		var holder *string
		db.QueryRow(ctx, `SELECT leased_by, lease_token FROM leash.jobs WHERE id = $1`, id).Scan(&holder, &tokenB)
		return holder != nil && *holder == "B"
	})
	if tokenB == tokenA {
		t.Fatalf("takeover kept token %d", tokenA)
	}
	t.Logf("taken over %s after SIGSTOP", time.Since(stopped).Round(time.Millisecond))
	a.Process.Signal(syscall.SIGCONT)
	poll(t, 20*time.Second, "the job to complete", func() bool {
		var state string
		db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&state)
		return state == "completed"
	})
	// Thawed, A learns it lost the job from whichever comes first: its trust window (and then
	// its fenced outcome is rejected), the takeover notification, or its next renewal.
	poll(t, 10*time.Second, "A to report that it lost the lease", func() bool {
		l := logsA.String()
		return strings.Contains(l, "job outcome rejected") || strings.Contains(l, "handler stopped after losing its lease")
	})
	var attempt int
	var errs string
	db.QueryRow(ctx, `SELECT attempt, errors::text FROM leash.jobs WHERE id = $1`, id).Scan(&attempt, &errs)
	if attempt != 2 || !strings.Contains(errs, "worker A stopped renewing") {
		t.Fatalf("attempt %d, errors %s", attempt, errs)
	}
	if err := a.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("A died after SIGCONT: %v\n%s", err, logsA.String())
	}
	a.Process.Signal(syscall.SIGTERM)
	if err := a.Wait(); err != nil {
		t.Fatalf("A exit: %v", err)
	}
}

// The newcomer's first command, on a machine with PostgreSQL installed but not running.
func TestDemo(t *testing.T) {
	t.Parallel()
	out, err := runCmd(t, envOf(), "demo")
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	for _, want := range []string{"Starting a private PostgreSQL", "NOTIFY job_revoked", "cancelled by its worker in",
		"Summary", "flaky  completed  6", "cancelled (by NOTIFY job_revoked)", "Private PostgreSQL stopped and removed.",
		// The test binary is built like a `go run` one and runs in this package's directory.
		"export DATABASE_URL='postgres://USER:PASSWORD@HOST:5432/DBNAME'", "  go run . migrate "} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

func TestHealthProbe(t *testing.T) {
	t.Parallel()
	var status atomic.Int32
	status.Store(200)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(int(status.Load()))
		fmt.Fprintln(w, "listener not connected")
	}))
	defer srv.Close()
	if _, err := runCmd(t, envOf(), "health", "-url", srv.URL+"/readyz"); err != nil {
		t.Fatalf("healthy: %v", err)
	}
	status.Store(503)
	if _, err := runCmd(t, envOf(), "health", "-url", srv.URL+"/readyz"); err == nil || !strings.Contains(err.Error(), "listener not connected") {
		t.Fatalf("unhealthy: %v", err)
	}
	if _, err := runCmd(t, envOf(), "health"); err == nil {
		t.Fatal("no address accepted")
	}
}

// startBouncer starts PgBouncer in transaction mode in front of a fresh database of the test
// cluster (default_pool_size server connections at most) and returns the database's direct URL,
// the URL through PgBouncer and PgBouncer's log. It skips the test when PgBouncer is not
// installed, unless LEASH_REQUIRE_PGBOUNCER is set.
func startBouncer(t *testing.T, poolSize int) (direct, viaBouncer string, bouncerLog *syncbuf.Buffer) {
	t.Helper()
	bouncer, err := exec.LookPath("pgbouncer")
	if err != nil {
		for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"} {
			if _, serr := os.Stat(p); serr == nil {
				bouncer, err = p, nil
			}
		}
	}
	if err != nil {
		if os.Getenv("LEASH_REQUIRE_PGBOUNCER") != "" {
			t.Fatal("pgbouncer not installed (Debian package pgbouncer)")
		}
		t.Skip("pgbouncer not installed; set LEASH_REQUIRE_PGBOUNCER=1 to make this a failure")
	}
	direct = pgtest.URL(t)
	cfg, _ := pgx.ParseConfig(direct)
	// Readable by the postgres user PgBouncer runs as when the tests run as root (t.TempDir's
	// parent is private).
	dir, err := os.MkdirTemp("", "leash-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%d
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s/users.txt
pool_mode = transaction
max_client_conn = 200
default_pool_size = %d
ignore_startup_parameters = extra_float_digits
`, cfg.Host, cfg.Port, port, dir, poolSize)
	os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644)
	os.WriteFile(filepath.Join(dir, "users.txt"), []byte(`"postgres" ""`+"\n"), 0o644)
	cmd := exec.Command(bouncer, filepath.Join(dir, "pgbouncer.ini"))
	if os.Geteuid() == 0 { // PgBouncer refuses to run as root
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skip("running as root without a postgres user to run PgBouncer as")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, Pdeathsig: syscall.SIGKILL}
	}
	bouncerLog = &syncbuf.Buffer{}
	cmd.Stdout, cmd.Stderr = bouncerLog, bouncerLog
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("pgbouncer:\n%s", bouncerLog.String())
		}
	})
	viaBouncer = fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&default_query_exec_mode=exec", cfg.User, port, cfg.Database)
	poll(t, 10*time.Second, "PgBouncer to listen", func() bool {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return direct, viaBouncer, bouncerLog
}

// The deployment of the PgBouncer notes in docs/operations.md: the pool through PgBouncer in transaction mode
// (with default_query_exec_mode=exec, which PgBouncer before 1.21 needs), LISTEN on a direct
// LISTEN_DATABASE_URL. Jobs drain, a console revocation lands, SIGTERM exits 0.
func TestBehindPgBouncer(t *testing.T) {
	t.Parallel()
	direct, viaBouncer, bouncerLog := startBouncer(t, 10)
	cfg, _ := pgx.ParseConfig(direct)

	// The test cluster runs with synchronous_commit = off for speed. Through a pooler leash cannot
	// raise it on its connections and warns (docs/operations.md, Database settings): set as an operator would.
	pgtest.Exec(t, direct, "ALTER DATABASE "+pgx.Identifier{cfg.Database}.Sanitize()+" SET synchronous_commit = on")
	db := pgtest.PoolFor(t, direct)
	ctx := context.Background()
	db.Exec(ctx, `INSERT INTO leash.jobs (kind) SELECT 'noop' FROM generate_series(1, 300)`)
	var long int64
	db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"1m","progress":true}') RETURNING id`).Scan(&long)
	var logs syncbuf.Buffer
	w := startWorker(t, buildWorker(t), &logs, "DATABASE_URL="+viaBouncer, "LISTEN_DATABASE_URL="+direct,
		"WORKER_HEARTBEAT_INTERVAL=500ms", "WORKER_LEASE_DURATION=2s", "WORKER_POLL_INTERVAL=100ms", "WORKER_SHUTDOWN_TIMEOUT=1s")
	poll(t, 30*time.Second, "300 jobs through PgBouncer, and the long one running", func() bool {
		var done int
		var running bool
		db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed'), bool_or(state = 'running' AND progress IS NOT NULL) FROM leash.jobs`).Scan(&done, &running)
		return done == 300 && running
	})
	db.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", long))
	poll(t, 10*time.Second, "the revocation", func() bool {
		var state string
		db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, long).Scan(&state)
		return state == "cancelled"
	})
	w.Process.Signal(syscall.SIGTERM)
	if err := w.Wait(); err != nil {
		t.Fatalf("exit: %v", err)
	}
	if strings.Contains(logs.String(), `"level":"WARN"`) || strings.Contains(logs.String(), `"level":"ERROR"`) {
		t.Fatalf("worker logged problems behind PgBouncer:\n%s\npgbouncer:\n%s", logs.String(), bouncerLog.String())
	}
}

// The commands that read leash's tables, on a database nobody migrated, say to migrate.
func TestCommandsOnAnUnmigratedDatabaseSayMigrate(t *testing.T) {
	t.Parallel()
	env := envOf("DATABASE_URL", pgtest.EmptyURL(t))
	for _, args := range [][]string{{"status"}, {"status", "1"}, {"queue", "list"}, {"schedule", "list"}, {"retry", "1"}} {
		_, err := runCmd(t, env, args...)
		if err == nil || !strings.Contains(err.Error(), "run `worker migrate` first") {
			t.Errorf("worker %s on an unmigrated database: %v", strings.Join(args, " "), err)
		}
	}
}

// JSON logs write durations as text.
func TestJSONLogDurationsAreText(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	newLogger(env{LogFormat: "json"}, &buf).Info("x", slog.Duration("timeout", 30*time.Second))
	if !strings.Contains(buf.String(), `"timeout":"30s"`) {
		t.Fatalf("JSON log %s", buf.String())
	}
}

// A fleet of 32 workers behind PgBouncer in transaction mode, each with its listener direct, on a
// database limited to 100 connections: every worker starts (none is refused a connection), the
// jobs drain across the fleet, a console revocation lands, and the database never sees more than
// the 32 listeners, PgBouncer's 20 server connections and the test's own. Every worker stops
// cleanly on SIGTERM.
func TestFleetBehindPgBouncerWithin100Connections(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("32 worker processes")
	}
	const workers, serverConns, limit = 32, 20, 100
	direct, viaBouncer, bouncerLog := startBouncer(t, serverConns)
	cfg, _ := pgx.ParseConfig(direct)
	dbName := pgx.Identifier{cfg.Database}.Sanitize()
	pgtest.Exec(t, direct, "ALTER DATABASE "+dbName+" SET synchronous_commit = on")
	pgtest.Exec(t, direct, fmt.Sprintf("ALTER DATABASE %s CONNECTION LIMIT %d", dbName, limit))
	db := pgtest.PoolFor(t, direct)
	ctx := context.Background()
	const jobs = 3000
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)`, jobs); err != nil {
		t.Fatal(err)
	}
	var long int64
	db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"1m"}') RETURNING id`).Scan(&long)

	// The most connections the database held, sampled until the test ends.
	var peak atomic.Int64
	sampling, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampling.Err() == nil {
			var n int64
			if db.QueryRow(sampling, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()`).Scan(&n) == nil && n > peak.Load() {
				peak.Store(n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	defer func() { stopSampling(); <-sampled }()

	bin := buildWorker(t)
	logs := make([]*syncbuf.Buffer, workers)
	procs := make([]*exec.Cmd, workers)
	for i := range workers {
		logs[i] = &syncbuf.Buffer{}
		procs[i] = startWorker(t, bin, logs[i], "DATABASE_URL="+viaBouncer, "LISTEN_DATABASE_URL="+direct,
			fmt.Sprintf("WORKER_ID=w%02d", i), "WORKER_CONCURRENCY=4", "WORKER_DB_MAX_CONNS=3", "WORKER_CONTROL_CONNS=2",
			"WORKER_HEARTBEAT_INTERVAL=500ms", "WORKER_LEASE_DURATION=3s", "WORKER_POLL_INTERVAL=200ms",
			"WORKER_SHUTDOWN_TIMEOUT=1s")
	}
	poll(t, 90*time.Second, "the fleet to drain the jobs, every listener connected, the long job running", func() bool {
		var done, listeners int
		var running bool
		db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed'), coalesce(bool_or(id = $1 AND state = 'running'), false) FROM leash.jobs`, long).Scan(&done, &running)
		db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'leash-listener'`).Scan(&listeners)
		return done == jobs && running && listeners == workers
	})
	db.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", long))
	poll(t, 10*time.Second, "the revocation", func() bool {
		var state string
		db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, long).Scan(&state)
		return state == "cancelled"
	})
	for i, w := range procs {
		w.Process.Signal(syscall.SIGTERM)
		if err := w.Wait(); err != nil {
			t.Fatalf("worker %d exit: %v\n%s", i, err, logs[i].String())
		}
	}
	for i, l := range logs {
		if s := l.String(); strings.Contains(s, `"level":"ERROR"`) || strings.Contains(s, "too many") || strings.Contains(s, "53300") {
			t.Fatalf("worker %d logged errors:\n%s\npgbouncer:\n%s", i, s, bouncerLog.String())
		}
	}
	stopSampling()
	<-sampled
	t.Logf("peak connections to the database: %d (limit %d; %d listeners, PgBouncer's %d, the test's own)", peak.Load(), limit, workers, serverConns)
	if peak.Load() > limit {
		t.Fatalf("the fleet held %d connections, over the limit of %d", peak.Load(), limit)
	}
}
