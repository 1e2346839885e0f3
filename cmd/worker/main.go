// Command worker is leash's standalone binary: it runs a worker pool with the built-in handlers,
// applies migrations, enqueues and revokes jobs, and shows the queue's status. Configuration
// comes from the environment (see the README); `worker help` lists the subcommands.
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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/lmittmann/tint"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/term"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/internal/metrics"
	"github.com/leashq/leash/internal/netdial"
	"github.com/leashq/leash/internal/web"
	"github.com/leashq/leash/pool"
)

const usage = `usage: worker [command] [flags]

commands:
  run       run a worker pool (the default)
  migrate   apply pending schema migrations
  enqueue   add a job: worker enqueue -kind sleep -payload '{"duration":"2s"}'
  revoke    revoke a job: worker revoke ID [-reason TEXT]
  status    show counts per queue and state, and the running jobs
  health    probe a running worker's /readyz (for container health checks)
  demo      a guided tour on a private PostgreSQL (or DATABASE_URL): workload, revocation, summary

configuration is read from the environment; DATABASE_URL is required.
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
	e, err := loadEnv(ctx, getenv)
	if err != nil {
		return err
	}
	log := newLogger(e, stderr)
	switch cmd {
	case "run":
		return cmdRun(ctx, e, log)
	case "migrate":
		return cmdMigrate(ctx, e, stdout)
	case "enqueue":
		return cmdEnqueue(ctx, e, args, stdout, stderr)
	case "revoke":
		return cmdRevoke(ctx, e, args, stdout, stderr)
	case "status":
		return cmdStatus(ctx, e, stdout)
	case "demo":
		return cmdDemo(ctx, e, stdout)
	}
	return fmt.Errorf("unknown command %q\n%s", cmd, usage)
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
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level}))
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
	cfg.ConnConfig.DialFunc = netdial.Dialer().DialContext
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.Ping(pctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("cannot reach the database at %s:%d: %w", cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	return db, nil
}

func cmdRun(ctx context.Context, e env, log *slog.Logger) error {
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	if e.AutoMigrate {
		if _, err := pool.Migrate(ctx, db); err != nil {
			return err
		}
	}
	cfg := e.poolConfig()
	cfg.Logger = log
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
	if err := handlers.Register(p, handlers.Options{ExecAllow: e.ExecAllow, ExecGrace: e.ExecGrace, HTTPPolicy: policy}); err != nil {
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
	h, err := web.New(web.Options{DB: db, ListenerConnected: p.ListenerConnected, Gatherer: reg,
		AdminToken: token, AdminOpen: open, AdminHosts: hosts, Logger: log})
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

func cmdMigrate(ctx context.Context, e env, stdout io.Writer) error {
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	applied, err := pool.Migrate(ctx, db)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
		return nil
	}
	fmt.Fprintf(stdout, "applied migrations %v\n", applied)
	return nil
}
