// Command worker is leash's standalone binary: it runs a worker pool with the built-in handlers,
// applies migrations, enqueues and revokes jobs, and shows the queue's status. Configuration
// comes from the environment (see docs/worker.md); `worker help` lists the subcommands.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	_ "time/tzdata" // CRON_TZ zones resolve in images without a zone database

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/lmittmann/tint"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/term"

	"github.com/leashq/leash/cmd/worker/internal/metrics"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/pool"
)

const usage = `usage: worker [command] [flags]

commands:
  run       run a worker pool (the default)
  migrate   apply pending schema migrations; -status lists applied and pending ones
  enqueue   add a job: worker enqueue -kind sleep -payload '{"duration":"2s"}'
  revoke    revoke a job: worker revoke ID [-reason TEXT]
  retry     run a failed or cancelled job once more: worker retry ID
  status    show counts per queue and state, and the running jobs; status ID shows one job and its output
  queue     list, pause, resume, cap or limit per key queues: worker queue pause NAME (see worker queue)
  schedule  list, add or remove durable periodic jobs (see worker schedule)
  workflow  show a workflow's jobs or revoke them: worker workflow show|revoke ID
  health    probe a running worker's /readyz (for container health checks)
  demo      a guided tour on a private PostgreSQL (or DATABASE_URL): workload, revocation, summary
  version   print the release, the revision it was built from and the schema version it needs

configuration is read from the environment; DATABASE_URL is required. Tracing is on when
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER=otlp) is set.
`

func main() {
	err := run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "worker:", err)
		os.Exit(1)
	}
}

// run is the whole binary, testable: args without the program name, the environment as a
// function, and the output streams.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cmd := "run"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	if cmd == "help" || cmd == "-h" || cmd == "--help" {
		fmt.Fprint(stdout, usage)
		return nil
	}
	if cmd == "health" {
		return cmdHealth(ctx, getenv, args, stdout)
	}
	if cmd == "version" {
		cmdVersion(stdout)
		return nil
	}
	e, err := loadEnv(ctx, getenv)
	if err != nil {
		return err
	}
	log := newLogger(e, stderr)
	return schemaHint(cmd, runCommand(ctx, cmd, e, args, getenv, log, stdout, stderr))
}

// runCommand runs one of the commands that need the environment.
func runCommand(ctx context.Context, cmd string, e env, args []string, getenv func(string) string, log *slog.Logger,
	stdout, stderr io.Writer) error {
	switch cmd {
	case "run":
		return cmdRun(ctx, e, getenv, log)
	case "migrate":
		return cmdMigrate(ctx, e, args, stdout, stderr)
	case "enqueue":
		return cmdEnqueue(ctx, e, args, stdout, stderr)
	case "revoke":
		return cmdRevoke(ctx, e, args, stdout, stderr)
	case "status":
		return cmdStatus(ctx, e, args, stdout)
	case "queue":
		return cmdQueue(ctx, e, args, stdout)
	case "retry":
		return cmdRetry(ctx, e, args, stdout)
	case "schedule":
		return cmdSchedule(ctx, e, args, stdout, stderr)
	case "workflow":
		return cmdWorkflow(ctx, e, args, stdout, stderr)
	case "demo":
		return cmdDemo(ctx, e, stdout)
	}
	return fmt.Errorf("unknown command %q\n%s", cmd, usage)
}

// schemaHint adds what to do to an error of a command that met a database without leash's
// schema (or with an older one lacking a table or function): migrate.
func schemaHint(cmd string, err error) error {
	var pe *pgconn.PgError
	if err == nil || cmd == "migrate" || !errors.As(err, &pe) {
		return err
	}
	switch pe.Code {
	case "3F000", "42P01", "42883": // invalid_schema_name, undefined_table, undefined_function
		return fmt.Errorf("%w\nthe database lacks (part of) leash's schema: run `worker migrate` first (`worker migrate -status` shows what is applied)", err)
	}
	return err
}

func newLogger(e env, w io.Writer) *slog.Logger {
	var level slog.Level
	level.UnmarshalText([]byte(e.LogLevel))
	format := e.LogFormat
	if format == "" {
		format = "json"
		if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			format = "tint"
		}
	}
	switch format {
	case "tint":
		return slog.New(tint.NewTextHandler(w, &tint.Options{Level: level, TimeFormat: time.TimeOnly}))
	case "text":
		return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
	}
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level, ReplaceAttr: durationText}))
}

// durationText writes durations as Go duration text ("30s"), not as nanoseconds, in JSON logs.
func durationText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}

// connect opens the pool and checks that the database answers, so a database that is down at
// start is reported clearly instead of at the first claim.
func connect(ctx context.Context, e env) (*pgxpool.Pool, error) {
	if e.DatabaseURL == "" {
		return nil, errors.New("DATABASE_URL is not set (e.g. postgres://user:pass@localhost:5432/db)")
	}
	cfg, err := pgxpool.ParseConfig(e.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	if !strings.Contains(e.DatabaseURL, "pool_max_conns") {
		cfg.MaxConns = e.DBMaxConns
	}
	// Every statement on this pool is leash's own (the built-in handlers write only their
	// progress): it runs with leash's session settings, unless a pooler refuses them.
	return pool.Connect(ctx, cfg)
}

func cmdRun(ctx context.Context, e env, getenv func(string) string, log *slog.Logger) error {
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := checkSchema(ctx, e, db, log); err != nil {
		return err
	}
	cfg := e.poolConfig()
	cfg.Logger = log
	stopTracing, err := startTracing(ctx, getenv, &cfg, log)
	if err != nil {
		return err
	}
	defer stopTracing()
	if e.ListenDatabaseURL != "" {
		lc, err := pgx.ParseConfig(e.ListenDatabaseURL)
		if err != nil {
			return fmt.Errorf("LISTEN_DATABASE_URL: %w", err)
		}
		cfg.ListenConfig = lc
	}
	// Listen first: the http handler must know the endpoints' address to keep jobs off it.
	var ln net.Listener
	if e.HTTPAddr != "" {
		if ln, err = net.Listen("tcp", e.HTTPAddr); err != nil {
			return fmt.Errorf("WORKER_HTTP_ADDR: %w", err)
		}
		defer ln.Close()
	}
	reg := prometheus.NewRegistry()
	if ln != nil {
		cfg.Observer = metrics.NewObserver(reg)
	}
	p, err := pool.New(db, cfg)
	if err != nil {
		return err
	}
	allow, _ := e.webhookAllow() // checked by loadEnv
	policy := handlers.HTTPPolicy{BlockPrivate: e.WebhookBlockPrivate, Allow: allow}
	if ln != nil {
		policy.Self = ln.Addr().String()
	}
	if err := handlers.Register(p, handlers.Options{ExecAllow: e.ExecAllow, ExecGrace: e.ExecGrace, ExecEnvAllow: e.ExecEnvAllow, HTTPPolicy: policy}); err != nil {
		return err
	}
	if ln != nil {
		metrics.RegisterPool(reg, p, db)
		stop, err := serveHTTP(e, ln, db, p, reg, log)
		if err != nil {
			return err
		}
		defer stop()
	}

	// Every worker offers to sample the minute statistics of the admin page's charts, so that the
	// page has them whichever worker serves it.
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go sampleStats(sampleCtx, db, log, statsSampleInterval, sampled)
	defer func() { stopSampling(); <-sampled }()

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	runErr := make(chan error, 1)
	go func() { runErr <- p.Run(ctx) }()
	select {
	case err := <-runErr:
		return err
	case sig := <-sigs:
		log.Info("stopping: no new jobs; running jobs get the shutdown timeout",
			slog.String("signal", sig.String()), slog.Duration("timeout", e.ShutdownTimeout))
	}
	sctx, cancel := context.WithTimeout(context.Background(), e.ShutdownTimeout)
	defer cancel()
	go func() {
		select {
		case sig := <-sigs:
			log.Warn("second signal: cancelling running jobs now", slog.String("signal", sig.String()))
			cancel()
		case <-sctx.Done():
		}
	}()
	p.Shutdown(sctx)
	return <-runErr
}

// serveHTTP serves the health, metrics and admin endpoints on ln; the returned function stops
// them.
//
// The admin page needs WORKER_ADMIN_TOKEN. Without one it is served openly only when ln is on
// loopback; on any other address a random token is made for this run and logged once, so the
// page is never open to the network by omission.
func serveHTTP(e env, ln net.Listener, db *pgxpool.Pool, p *pool.Pool, reg *prometheus.Registry, log *slog.Logger) (func(), error) {
	token, open := e.AdminToken, false
	if token == "" {
		if tcp, ok := ln.Addr().(*net.TCPAddr); ok && tcp.IP.IsLoopback() {
			open = true
			log.Info("admin page served without a token: WORKER_HTTP_ADDR is loopback only")
		} else {
			token = rand.Text()
			log.Warn("admin page: WORKER_ADMIN_TOKEN is not set and WORKER_HTTP_ADDR is not loopback only; "+
				"this run's admin token (basic-auth password with any user name, or Authorization: Bearer) is",
				slog.String("admin_token", token))
		}
	}
	hosts := slices.Clone(e.AdminHosts)
	if host, _, err := net.SplitHostPort(e.HTTPAddr); err == nil && host != "" {
		hosts = append(hosts, host) // the configured name; IP literals are accepted anyway
	}
	h, err := web.New(web.Options{DB: db, Ready: p.Ready, Gatherer: reg,
		AdminToken: token, AdminOpen: open, AdminHosts: hosts, ReportSchema: true, Release: pool.Release, Logger: log})
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	log.Info("http endpoints listening", slog.String("addr", ln.Addr().String()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	}, nil
}

// cmdHealth asks a running worker (on WORKER_HTTP_ADDR, or -url) whether it is ready; the exit
// status says. It needs no database settings, for container health checks.
func cmdHealth(ctx context.Context, getenv func(string) string, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	addr := getenv("WORKER_HTTP_ADDR")
	if strings.HasPrefix(addr, ":") {
		addr = "127.0.0.1" + addr
	}
	u := fs.String("url", "http://"+addr+"/readyz", "readiness URL to probe")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if addr == "" && !strings.Contains(strings.Join(args, " "), "-url") {
		return errors.New("health: WORKER_HTTP_ADDR is not set and no -url given")
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, *u, nil)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("health: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	fmt.Fprint(stdout, string(body))
	return nil
}

// cmdMigrate applies the pending migrations and prints each, or with -status lists the applied
// and pending ones.
func cmdMigrate(ctx context.Context, e env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	status := fs.Bool("status", false, "list applied migrations (with when) and pending ones; change nothing")
	lockTimeout := fs.Duration("lock-timeout", migrateLockTimeout, "longest wait for a table lock before giving up and trying again "+
		"(queries on the table queue behind the waiting migration); 0: wait as long as it takes")
	retryFor := fs.Duration("retry-for", migrateRetryFor, "keep trying this long when a lock is not granted in time")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("migrate: unexpected argument %q", fs.Arg(0))
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	if *status {
		return printSchemaStatus(ctx, db, stdout)
	}
	applied, err := applyRetrying(ctx, db, *lockTimeout, *retryFor, func(m pool.Migration) {
		fmt.Fprintf(stdout, "applied %d %s\n", m.Version, m.Name)
	}, func(msg string) { fmt.Fprintln(stdout, msg) })
	if err != nil {
		return err
	}
	c, err := pool.ReadSchemaStatus(ctx, db)
	if err != nil {
		return err
	}
	switch {
	case c.Ahead():
		fmt.Fprintf(stdout, "schema is at version %d, newer than this worker's %d (release %s): nothing to apply\n",
			c.Current, c.Expected, pool.Release)
	case len(applied) == 0:
		fmt.Fprintf(stdout, "schema is up to date (version %d)\n", c.Current)
	default:
		fmt.Fprintf(stdout, "schema is at version %d\n", c.Current)
	}
	return nil
}

// Defaults of `worker migrate` and of WORKER_AUTO_MIGRATE: a migration waiting for a table lock
// makes every query on that table wait behind it, so it gives up after a short wait and tries
// again a little later, while the fleet goes on.
const (
	migrateLockTimeout = 2 * time.Second
	migrateRetryFor    = 2 * time.Minute
	migrateRetryPause  = 3 * time.Second
)

// applyRetrying applies the pending migrations, each transaction giving up on a lock after
// lockTimeout and tried again after a pause until retryFor has passed. It reports every
// migration applied, and every retry.
func applyRetrying(ctx context.Context, db *pgxpool.Pool, lockTimeout, retryFor time.Duration,
	applied func(pool.Migration), retrying func(string)) ([]pool.Migration, error) {
	deadline := time.Now().Add(retryFor)
	var all []pool.Migration
	for {
		done, err := pool.MigrateWith(ctx, db, pool.MigrateOptions{LockTimeout: lockTimeout})
		for _, m := range done {
			applied(m)
		}
		all = append(all, done...)
		if err == nil || !errors.Is(err, pool.ErrMigrationLockTimeout) {
			return all, err
		}
		if time.Now().Add(migrateRetryPause).After(deadline) {
			return all, fmt.Errorf("%w\nanother transaction held a lock on leash's tables longer than the lock timeout (%s) "+
				"every time for %s: find it in pg_stat_activity (pg_blocking_pids), or retry with a longer -lock-timeout or -retry-for", err, lockTimeout, retryFor)
		}
		retrying(fmt.Sprintf("a lock on leash's tables was not granted within %s (another transaction holds it); "+
			"nothing of that transaction was applied; trying again in %s", lockTimeout, migrateRetryPause))
		select {
		case <-ctx.Done():
			return all, context.Cause(ctx)
		case <-time.After(migrateRetryPause):
		}
	}
}

func printSchemaStatus(ctx context.Context, db *pgxpool.Pool, stdout io.Writer) error {
	c, err := pool.ReadSchemaStatus(ctx, db)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	if !c.Tracked {
		fmt.Fprintln(tw, "applied:\tnone (leash.schema_migrations does not exist)")
	} else if len(c.Applied) == 0 {
		fmt.Fprintln(tw, "applied:\tnone")
	} else {
		fmt.Fprintln(tw, "applied:")
		for _, a := range c.Applied {
			note := ""
			if slices.Contains(c.Unknown, a) {
				note = "\tnot known to this worker (applied by a newer release)"
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s%s\n", a.Version, a.Name, a.AppliedAt.UTC().Format(time.RFC3339), note)
		}
	}
	if len(c.Pending) == 0 {
		fmt.Fprintln(tw, "pending:\tnone")
	} else {
		fmt.Fprintln(tw, "pending:")
		for _, m := range c.Pending {
			fmt.Fprintf(tw, "  %d\t%s\t\n", m.Version, m.Name)
		}
	}
	tw.Flush()
	switch {
	case c.Behind():
		fmt.Fprintf(stdout, "schema is at version %d; this worker (release %s) needs %d: run `worker migrate`\n", c.Current, pool.Release, c.Expected)
	case c.Ahead():
		fmt.Fprintf(stdout, "schema is at version %d, newer than this worker's %d (release %s): upgrade the worker\n", c.Current, c.Expected, pool.Release)
	default:
		fmt.Fprintf(stdout, "schema is at version %d, as this worker (release %s) expects\n", c.Current, pool.Release)
	}
	return nil
}

// checkSchema refuses to run on a database that lacks migrations this worker needs (or applies
// them with WORKER_AUTO_MIGRATE), and warns when the database was migrated by a newer release.
func checkSchema(ctx context.Context, e env, db *pgxpool.Pool, log *slog.Logger) error {
	c, err := pool.ReadSchemaStatus(ctx, db)
	if err != nil {
		return err
	}
	if c.Behind() && e.AutoMigrate {
		_, err := applyRetrying(ctx, db, migrateLockTimeout, migrateRetryFor, func(m pool.Migration) {
			log.Info("applied migration (WORKER_AUTO_MIGRATE)", slog.Int("version", m.Version), slog.String("name", m.Name))
		}, func(msg string) { log.Warn(msg) })
		if err != nil {
			return err
		}
		if c, err = pool.ReadSchemaStatus(ctx, db); err != nil {
			return err
		}
	}
	if c.Behind() {
		return schemaBehindError(c)
	}
	if c.Ahead() {
		log.Warn(web.SchemaAheadNote(c, pool.Release),
			slog.Int("schema_version", c.Current), slog.Int("worker_schema_version", c.Expected), slog.String("release", pool.Release))
	}
	return nil
}

func schemaBehindError(c pool.SchemaStatus) error {
	const fix = "run `worker migrate` (or start the worker with WORKER_AUTO_MIGRATE=true)"
	if !c.Tracked {
		return fmt.Errorf("database has no leash schema (leash.schema_migrations does not exist), this worker needs version %d: %s", c.Expected, fix)
	}
	names := make([]string, len(c.Pending))
	for i, m := range c.Pending {
		names[i] = m.Name
	}
	if c.Current < c.Pending[0].Version {
		return fmt.Errorf("database schema is at version %d, this worker needs %d: %s (pending: %s)", c.Current, c.Expected, fix, strings.Join(names, ", "))
	}
	return fmt.Errorf("database schema lacks %s, which this worker needs: %s", strings.Join(names, ", "), fix)
}
