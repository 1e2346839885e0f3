package faults_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// Timings of every worker process in the suite: short, so faults play out in seconds.
const (
	leaseDuration   = 2 * time.Second
	heartbeat       = 400 * time.Millisecond
	pollInterval    = 100 * time.Millisecond
	reconnectDelay  = 300 * time.Millisecond
	shutdownTimeout = time.Second
)

// event is one line of a worker's execution log: a handler starting or ending an attempt.
type event struct {
	Ev     string `json:"ev"` // start, end
	Job    int64  `json:"job"`
	Token  int64  `json:"token"`
	Worker string `json:"worker"`
	At     int64  `json:"at"` // unix nanoseconds, wall clock (the same machine as PostgreSQL)
	Cause  string `json:"cause,omitempty"`
}

// ledgerArgs is the payload of the suite's jobs.
type ledgerArgs struct {
	MS int `json:"ms"` // how long the handler works before writing its effect
}

// runWorker runs this test binary as a worker process when FAULT_WORKER is set. Its handlers
// write their side effect to a ledger table through the job's fence, in the same transaction as
// the completion, and log every start and end to a file that survives the process.
func runWorker() bool {
	id := os.Getenv("FAULT_WORKER")
	if id == "" {
		return false
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("FAULT_DB"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	cfg.MaxConns = 12
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	logf, err := os.OpenFile(os.Getenv("FAULT_EVENTS"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var mu sync.Mutex
	record := func(ev event) {
		ev.Worker, ev.At = id, time.Now().UnixNano()
		b, _ := json.Marshal(ev)
		mu.Lock()
		logf.Write(append(b, '\n'))
		mu.Unlock()
	}
	conc, _ := strconv.Atoi(os.Getenv("FAULT_CONCURRENCY"))
	p, err := pool.New(db, pool.Config{
		ID: id, Concurrency: conc,
		LeaseDuration: leaseDuration, HeartbeatInterval: heartbeat, PollInterval: pollInterval,
		RescueInterval: 250 * time.Millisecond, ShutdownTimeout: shutdownTimeout,
		ListenReconnectDelay: reconnectDelay, ListenPingInterval: time.Second,
		StallInterval: time.Second,
		RetryBackoff:  func(int) time.Duration { return 100 * time.Millisecond },
		Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	effect := func(ctx context.Context, j *pool.Job) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := j.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (job_id, token, worker) VALUES ($1, $2, $3)`, j.ID, j.Token, id); err != nil {
				return err
			}
			return j.CompleteTx(ctx, tx)
		})
	}
	work := func(ignoreCancel bool) pool.Handler {
		return pool.Args(func(ctx context.Context, j *pool.Job, a ledgerArgs) (err error) {
			record(event{Ev: "start", Job: j.ID, Token: j.Token})
			defer func() {
				cause := ""
				if err != nil {
					cause = err.Error()
				}
				record(event{Ev: "end", Job: j.ID, Token: j.Token, Cause: cause})
			}()
			if ignoreCancel {
				time.Sleep(time.Duration(a.MS) * time.Millisecond)
				return effect(context.Background(), j)
			}
			if err := pool.Sleep(ctx, time.Duration(a.MS)*time.Millisecond); err != nil {
				return err
			}
			return effect(ctx, j)
		})
	}
	p.Register("ledger", work(false))
	p.Register("deaf", work(true)) // ignores cancellation
	p.Register("panic", pool.HandlerFunc(func(context.Context, *pool.Job) error { panic("poison") }))
	p.Register("crash", pool.HandlerFunc(func(context.Context, *pool.Job) error { os.Exit(3); return nil }))
	p.Register("hang", pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		record(event{Ev: "start", Job: j.ID, Token: j.Token})
		select {} // never returns, ignores everything
	}))

	ctx, stop := signalContext()
	defer stop()
	runErr := make(chan error, 1)
	go func() { runErr <- p.Run(context.Background()) }()
	select {
	case err = <-runErr:
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		defer cancel()
		p.Shutdown(sctx)
		err = <-runErr
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
	return true
}
