package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/term"

	"github.com/leashq/leash/cmd/worker/internal/pgcluster"
	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/pool"
)

// demoQueue keeps the demo's jobs apart from any real ones when DATABASE_URL is set.
const demoQueue = "leash-demo"

// cmdDemo is the newcomer's first command: a private PostgreSQL (unless DATABASE_URL is set), a
// mixed workload with live progress, a revocation through NOTIFY job_revoked, and a summary.
func cmdDemo(ctx context.Context, e env, stdout io.Writer) error {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	say := func(format string, args ...any) { fmt.Fprintf(stdout, format+"\n", args...) }
	url := e.DatabaseURL
	if url == "" {
		say("Starting a private PostgreSQL from the local server binaries (removed on exit)...")
		c, err := pgcluster.Start(ctx)
		if err != nil {
			if errors.Is(err, pgcluster.ErrNoServer) {
				return fmt.Errorf("demo: %w; or set DATABASE_URL to use an existing server", err)
			}
			return fmt.Errorf("demo: %w", err)
		}
		defer func() { c.Close(); say("Private PostgreSQL stopped and removed.") }()
		url = c.URL("postgres")
	} else {
		say("Using DATABASE_URL; the demo's jobs go to queue %q.", demoQueue)
	}
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer db.Close()
	if _, err := pool.Migrate(ctx, db); err != nil {
		return fmt.Errorf("demo: %w", err)
	}

	// The worker, with short timings so that everything shows within seconds.
	p, err := pool.New(db, pool.Config{
		ID: "demo", Queues: []string{demoQueue}, Concurrency: 20,
		LeaseDuration: 3 * time.Second, HeartbeatInterval: time.Second, PollInterval: 200 * time.Millisecond,
		ShutdownTimeout: 2 * time.Second, RetryBackoff: func(int) time.Duration { return 500 * time.Millisecond },
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return err
	}
	if err := handlers.Register(p, handlers.Options{}); err != nil {
		return err
	}
	p.Register("flaky", pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		if j.Attempt == 1 {
			return errors.New("first attempt fails on purpose")
		}
		return pool.Sleep(ctx, 200*time.Millisecond)
	}))
	runDone := make(chan error, 1)
	go func() { runDone <- p.Run(context.WithoutCancel(ctx)) }()
	defer func() { p.Shutdown(context.Background()); <-runDone }()

	// The workload.
	var jobs []pool.InsertManyParams
	add := func(n int, kind string, payload any, maxAttempts int) {
		for range n {
			jobs = append(jobs, pool.InsertManyParams{Kind: kind, Payload: payload,
				Opts: &pool.InsertOpts{Queue: demoQueue, MaxAttempts: maxAttempts}})
		}
	}
	add(300, "noop", nil, 0)
	for i := range 12 {
		add(1, "sleep", map[string]any{"duration": fmt.Sprintf("%dms", 500+250*i), "progress": true}, 0)
	}
	add(6, "flaky", nil, 3)
	add(2, "sleep", map[string]any{"duration": "300ms", "fail": "this one always fails"}, 2)
	if _, err := pool.InsertMany(ctx, db, jobs); err != nil {
		return fmt.Errorf("demo: enqueue: %w", err)
	}
	victim, err := pool.Insert(ctx, db, "sleep", map[string]string{"duration": "10m"}, &pool.InsertOpts{Queue: demoQueue})
	if err != nil {
		return fmt.Errorf("demo: enqueue: %w", err)
	}
	total := len(jobs) + 1
	say("Enqueued %d jobs: 300 noop, 12 sleep with progress, 6 flaky (fail once, then succeed), 2 that always fail,", total)
	say("and job #%d, a 10-minute sleep that we will revoke from SQL.", victim)

	live := false
	if f, ok := stdout.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		live = true
	}
	progress := func() (done bool, err error) {
		c, err := demoCounts(ctx, db)
		if err != nil {
			return false, err
		}
		line := fmt.Sprintf("completed %d · running %d · waiting %d · retrying %d · failed %d · cancelled %d (of %d)",
			c["completed"], c["running"], c["available"], c["retryable"], c["failed"], c["cancelled"], total)
		if live {
			fmt.Fprintf(stdout, "\r\033[K%s", line)
		} else {
			fmt.Fprintln(stdout, line)
		}
		return c["completed"]+c["failed"]+c["cancelled"] == total, nil
	}

	// Revoke the long job through the console path, once it runs.
	revoked := make(chan string, 1)
	go func() { revoked <- demoRevoke(ctx, db, victim) }()

	every := time.Second
	if live {
		every = 150 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	var revokeMsg string
	for {
		select {
		case <-ctx.Done():
			fmt.Fprintln(stdout)
			return errors.New("demo interrupted")
		case revokeMsg = <-revoked:
			if live {
				fmt.Fprintln(stdout)
			}
			say("%s", revokeMsg)
			continue
		case <-tick.C:
		}
		done, err := progress()
		if err != nil {
			return err
		}
		if done && revokeMsg != "" {
			if live {
				fmt.Fprintln(stdout)
			}
			break
		}
	}
	if err := demoSummary(ctx, db, victim, stdout); err != nil {
		return err
	}
	fmt.Fprint(stdout, demoNext(thisWorkerCommand(), e.DatabaseURL))
	return nil
}

func demoCounts(ctx context.Context, db *pgxpool.Pool) (map[string]int, error) {
	rows, err := db.Query(ctx, `SELECT state, count(*) FROM leash.jobs WHERE queue = $1 GROUP BY 1`, demoQueue)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	c := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			return nil, err
		}
		c[s] = n
	}
	return c, rows.Err()
}

// demoRevoke waits for job id to run, sends NOTIFY job_revoked as an operator would from psql,
// and reports how long the worker took to record it cancelled.
func demoRevoke(ctx context.Context, db *pgxpool.Pool, id int64) string {
	for {
		var state string
		if err := db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&state); err != nil {
			return fmt.Sprintf("revocation: %v", err)
		}
		if state == "running" {
			break
		}
		select {
		case <-ctx.Done():
			return "revocation: interrupted"
		case <-time.After(20 * time.Millisecond):
		}
	}
	time.Sleep(time.Second) // let it run a moment, so the revocation visibly stops a live job
	sent := time.Now()
	if _, err := db.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", id)); err != nil {
		return fmt.Sprintf("revocation: %v", err)
	}
	for {
		var state string
		db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&state)
		if state == "cancelled" {
			return fmt.Sprintf(">>> psql> NOTIFY job_revoked, '%d';  -> job #%d cancelled by its worker in %s", id, id,
				time.Since(sent).Round(100*time.Microsecond))
		}
		if time.Since(sent) > 10*time.Second || ctx.Err() != nil {
			return fmt.Sprintf("revocation of job #%d did not land (state %s)", id, state)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func demoSummary(ctx context.Context, db *pgxpool.Pool, victim int64, stdout io.Writer) error {
	fmt.Fprintln(stdout, "\nSummary (from leash.jobs):")
	rows, err := db.Query(ctx, `
		SELECT kind, state, count(*), max(attempt), coalesce(max(last_error), '')
		FROM leash.jobs WHERE queue = $1 GROUP BY 1, 2 ORDER BY 1, 2`, demoQueue)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "KIND\tSTATE\tJOBS\tMAX ATTEMPT\tLAST ERROR")
	for rows.Next() {
		var kind, state, lastErr string
		var n, attempt int
		if err := rows.Scan(&kind, &state, &n, &attempt, &lastErr); err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%s\n", kind, state, n, attempt, lastErr)
	}
	rows.Close()
	w.Flush()
	var state, reason string
	db.QueryRow(ctx, `SELECT state, coalesce(revoke_reason, '') FROM leash.jobs WHERE id = $1`, victim).Scan(&state, &reason)
	fmt.Fprintf(stdout, "\nRevoked job #%d: %s (%s).\n", victim, state, reason)
	return nil
}

// demoNext is the demo's closing lines: the commands that take the user on from where they
// stand, with worker, the command that runs this binary there (workerCommand), and databaseURL,
// the DATABASE_URL the demo used ("" for its private server, gone by then).
func demoNext(worker, databaseURL string) string {
	var b strings.Builder
	if databaseURL == "" {
		b.WriteString("\nNext, on your own PostgreSQL server (the private one is removed on exit):\n")
		b.WriteString("  export DATABASE_URL='postgres://USER:PASSWORD@HOST:5432/DBNAME'\n")
	} else {
		b.WriteString("\nNext, on the database this demo used (the DATABASE_URL you gave it):\n")
		fmt.Fprintf(&b, "  export DATABASE_URL=%s\n", shellQuote(redactPassword(databaseURL)))
	}
	for _, c := range []string{
		"migrate                  # create or upgrade the leash schema",
		"run                      # run a worker (Ctrl-C hands its jobs back)",
		`enqueue -kind sleep -payload '{"duration":"5s"}'`,
		"status                   # counts per queue and state, and the running jobs",
	} {
		fmt.Fprintf(&b, "  %s %s\n", worker, c)
	}
	b.WriteString(`Enqueue from psql with INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"5s"}');
and revoke with SELECT leash.revoke_job(id, 'why') or NOTIFY job_revoked, 'id'.
`)
	return b.String()
}

// dsnPassword is the password of a keyword/value connection string.
var dsnPassword = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// redactPassword replaces the password of a connection string (a postgres:// URL or keyword/value
// pairs) by PASSWORD, for printing.
func redactPassword(databaseURL string) string {
	u, err := url.Parse(databaseURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return dsnPassword.ReplaceAllString(databaseURL, "${1}PASSWORD")
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "PASSWORD")
		}
	}
	if q := u.Query(); q.Has("password") {
		q.Set("password", "PASSWORD")
		u.RawQuery = q.Encode()
	}
	return u.String()
}

// workerCommand is the command that runs this binary from the directory cwd: for a binary that
// `go run` built (it lives in the go command's build directories), `go run` of srcDir, the
// directory of the binary's source ("" when the build trimmed paths: then the checkout's root
// is assumed); for an installed or built binary, arg0 as it was run when that names a path
// (./worker), else "worker", found on PATH.
func workerCommand(exe, arg0, srcDir, cwd string) string {
	if !builtByGoRun(exe) {
		if strings.ContainsRune(arg0, filepath.Separator) {
			return shellQuote(arg0)
		}
		return "worker"
	}
	if srcDir == "" || !filepath.IsAbs(srcDir) {
		return "go run ./cmd/worker"
	}
	rel, err := filepath.Rel(cwd, srcDir)
	switch {
	case err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)):
		return "go run -C " + shellQuote(srcDir) + " ."
	case rel == ".":
		return "go run ."
	default:
		return "go run " + shellQuote("./"+filepath.ToSlash(rel))
	}
}

// builtByGoRun reports whether exe lives where `go run` puts the binaries it builds: a go-build
// directory (the go command's temporary work directory, or its build cache).
func builtByGoRun(exe string) bool {
	for _, e := range strings.Split(filepath.ToSlash(filepath.Dir(exe)), "/") {
		if strings.HasPrefix(e, "go-build") {
			return true
		}
	}
	return false
}

// sourceDir is the directory of this package's source, as the compiler recorded it: absolute
// unless the build trimmed paths.
func sourceDir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(file) {
		return ""
	}
	return filepath.Dir(file)
}

// thisWorkerCommand is workerCommand for the running process, from the shell's directory: PWD,
// which `go run -C dir` leaves as it was, when it names the working directory or one above it.
func thisWorkerCommand() string {
	exe, _ := os.Executable()
	cwd, _ := os.Getwd()
	if pwd := os.Getenv("PWD"); filepath.IsAbs(pwd) {
		if rel, err := filepath.Rel(pwd, cwd); err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
			cwd = pwd
		}
	}
	return workerCommand(exe, os.Args[0], sourceDir(), cwd)
}

// shellQuote quotes s for a POSIX shell when it holds anything but safe characters.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@%+=,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
