// Package pool is what an application imports to run leash: enqueue jobs (Insert, InsertTx,
// InsertMany), register handlers by kind, and run a Pool that claims jobs into a bounded set of
// goroutines, keeps each on a lease (package lease), and writes every outcome fenced by the
// claim's token.
package pool

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/listener"
	"github.com/leashq/leash/internal/netdial"
	"github.com/leashq/leash/internal/store"
)

// counters count what a Pool did; Stats reads them. All fields are safe for concurrent use.
type counters struct {
	Lease  leasekeeper.Metrics
	Notify listener.Metrics

	Claims         atomic.Int64 // claim rounds (one or more statements each)
	Claimed        atomic.Int64
	Completed      atomic.Int64
	Retried        atomic.Int64
	Failed         atomic.Int64
	Cancelled      atomic.Int64
	HandedBack     atomic.Int64
	StaleWrites    atomic.Int64 // outcomes and writes rejected by the lease fence
	Panics         atomic.Int64
	Stalled        atomic.Int64 // handlers running on after their lease ended, at the last check
	Abandoned      atomic.Int64 // jobs left to their lease at shutdown because the handler did not stop
	TimedOut       atomic.Int64 // attempts cancelled by their timeout
	Pruned         atomic.Int64 // finished jobs deleted by retention
	ScheduledJobs  atomic.Int64 // jobs this worker enqueued for schedule ticks
	ScheduleErrors atomic.Int64 // schedules refused (bad spec) or ticks that could not be enqueued
	// Revocations by how they arrived.
	RevokedByNotification atomic.Int64
	RevokedByRenewal      atomic.Int64
	// SetAside counts rows a claim failed instead of leasing, because they cannot be claimed (an
	// attempt counter at the largest integer, which only an SQL client writes).
	SetAside atomic.Int64
	// RateLimited counts claims of a rate-limited queue that left it at its limit.
	RateLimited atomic.Int64
}

func (m *counters) count(state string) {
	switch state {
	case store.StateCompleted:
		m.Completed.Add(1)
	case store.StateRetryable:
		m.Retried.Add(1)
	case store.StateFailed:
		m.Failed.Add(1)
	case store.StateCancelled:
		m.Cancelled.Add(1)
	case store.StateAvailable:
		m.HandedBack.Add(1)
	}
}

// Pool claims and runs jobs. Create it with New, register handlers, then Run.
type Pool struct {
	db      *pgxpool.Pool // the application's pool: what handlers write through
	ctl     atomic.Pointer[pgxpool.Pool]
	cfg     Config
	log     *slog.Logger
	metrics *counters
	keeper  *leasekeeper.Keeper

	handlersMu sync.RWMutex
	handlers   map[string]Handler

	listener *listener.Listener
	events   *eventQueue    // delivers to Config.Observer; nil without one
	wake     chan struct{}  // a notification or a poll: there may be new jobs
	slotWake chan struct{}  // a handler returned: a slot is free
	active   atomic.Int64   // started attempts whose handler goroutine has not finished with them
	runs     sync.WaitGroup // attempts started and not yet run to their end (see runner)
	idle     chan run       // hands the next attempt to an idle runner
	jobsCtx  context.Context
	// runnerLabels carries only the profiler labels of Run's context, which a runner puts back
	// on its goroutine after each attempt.
	runnerLabels context.Context
	revocations  *recorder   // writes notified revocations into their rows
	waiterID     string      // this pool's name in leash.waiters
	wakeChannel  string      // the channel only this pool LISTENs on, for inserts that pick it
	picked       atomic.Bool // an insert picked this pool (a wake on wakeChannel) since it last re-armed
	// ownPollEvery is ownPollEvery, for this pool (tests raise it).
	ownPollEvery int
	gate         wakeGate      // holds back notifications that keep leading to nothing
	queues       queueView     // leash.queues as last read, for routing claims
	scan         claimScan     // where the next claim of a single queue starts
	unkeyed      unkeyedProbes // when the claims of queues with a per-key limit look for jobs without a key
	rates        rateHolds     // rate-limited queues at their limit, until when

	finishCh    chan finishItem
	outcomeWake chan struct{} // an outcome was queued: the finisher's flush interval starts
	deferredMu  sync.Mutex
	deferred    []finishItem // outcomes whose row was locked by another transaction
	// outcomes counts started attempts whose outcome is neither queued for the finisher nor
	// abandoned; the finisher stops only once it is zero, so no outcome is ever left behind.
	outcomes sync.WaitGroup

	runningMu sync.Mutex
	running   map[int64]*Job // every running attempt, by lease token; the one registry of claims
	attempts  sync.Map       // lease token -> *attemptState, for attempts that Config.Hooks observe

	settings atomic.Pointer[settingsCheck] // the last check of the database's settings
	unpinned atomic.Bool                   // the control connections could not pin leash's session settings

	started      atomic.Bool
	stopErr      error // what Shutdown returns; written by Run before done is closed
	shutdownOnce sync.Once
	shutdownCh   chan struct{}
	shutdownCtx  context.Context
	done         chan struct{}
}

// New returns a Pool working through db. The configuration is filled with defaults and
// validated.
func New(db *pgxpool.Pool, cfg Config) (*Pool, error) {
	if db == nil {
		return nil, errors.New("pool: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	p := &Pool{
		db: db, cfg: cfg, log: cfg.Logger.With(slog.String("worker", cfg.ID)), metrics: &counters{},
		handlers: map[string]Handler{}, wake: make(chan struct{}, 1), slotWake: make(chan struct{}, 1),
		finishCh: make(chan finishItem, 4*cfg.Concurrency+16), outcomeWake: make(chan struct{}, 1), idle: make(chan run),
		running: map[int64]*Job{}, shutdownCh: make(chan struct{}), done: make(chan struct{}),
	}
	if cfg.Observer != nil {
		p.events = newEventQueue(cfg.Observer, p.log)
	}
	p.revocations = newRecorder(p)
	p.waiterID = cfg.ID + "/" + rand.Text()[:8]
	p.wakeChannel = newWakeChannel()
	p.ownPollEvery = ownPollEvery
	p.gate.max = min(wakeHoldMax, cfg.PollInterval)
	p.keeper = leasekeeper.NewKeeper(controlDB{p}, cfg.leaseConfig(), p.leases, p.log, &p.metrics.Lease)
	if len(cfg.Hooks) > 0 {
		p.keeper.OnEnd = p.leaseEnded
	}
	p.listener = p.newListener()
	return p, nil
}

// control is the pool claims, renewals, outcomes, rescue and retention go through: connections
// of their own while Run runs, so that handlers using the application's pool can never starve
// them.
func (p *Pool) control() *pgxpool.Pool {
	if c := p.ctl.Load(); c != nil {
		return c
	}
	return p.db
}

// controlDB runs statements on the control pool.
type controlDB struct{ p *Pool }

func (c controlDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return c.p.control().Exec(ctx, sql, args...)
}

func (c controlDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return c.p.control().Query(ctx, sql, args...)
}

func (c controlDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return c.p.control().SendBatch(ctx, b)
}

func (c controlDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return c.p.control().QueryRow(ctx, sql, args...)
}

// openControl opens the control pool: the application pool's configuration (hooks, tracer,
// TLS) with Config.ControlConns connections, each with leash's session settings pinned
// (store.PinSession) unless a pooler refuses them.
func (p *Pool) openControl(ctx context.Context) (*pgxpool.Pool, error) {
	if p.cfg.ControlConns < 0 {
		p.unpinned.Store(true)
		return nil, nil
	}
	cc := p.db.Config().Copy()
	cc.MaxConns, cc.MinConns = int32(p.cfg.ControlConns), 0
	controlFailover(cc)
	ctl, err := p.openPinned(ctx, cc)
	if err != nil {
		return nil, fmt.Errorf("pool: open control connections: %w", err)
	}
	return ctl, nil
}

// controlFailover makes the control connections follow a failover on their own: a dead host
// is found in seconds (TCP keepalive and user timeout, on whatever DialFunc the application's
// pool has), each connection attempt gives up on a silent host after
// listener.ConnectTimeoutDefault unless connect_timeout says otherwise (so that the next host
// of a multi-host URL is tried), a server in recovery or read-only is refused (pgx tries the
// next host), and a connection whose server stopped taking writes is closed when released. A
// connection that broke is closed by pgx itself.
func controlFailover(cc *pgxpool.Config) {
	cc.ConnConfig.DialFunc = netdial.WithKeepAlive(cc.ConnConfig.DialFunc)
	if cc.ConnConfig.ConnectTimeout == 0 {
		cc.ConnConfig.ConnectTimeout = listener.ConnectTimeoutDefault
	}
	store.RefuseStandby(&cc.ConnConfig.Config)
	store.DropReadOnly(cc)
}

// leases returns the leases of the running jobs, for the keeper to renew.
func (p *Pool) leases() []*leasekeeper.Lease {
	p.runningMu.Lock()
	defer p.runningMu.Unlock()
	out := make([]*leasekeeper.Lease, 0, len(p.running))
	for _, j := range p.running {
		out = append(out, j.lease)
	}
	return out
}

// lookupJob returns the running attempt of job id; with token not zero, only that claim's. The
// same job may be running twice on this worker (claimed again while an attempt that was taken
// over is stopping): without a token, the attempt whose lease has not ended wins.
func (p *Pool) lookupJob(id, token int64) *Job {
	p.runningMu.Lock()
	defer p.runningMu.Unlock()
	if token != 0 {
		if j := p.running[token]; j != nil && j.claim.ID == id {
			return j
		}
		return nil
	}
	var found *Job
	for _, j := range p.running {
		if j.claim.ID == id && (found == nil || j.lease.Cause() == nil) {
			found = j
		}
	}
	return found
}

// Register sets the handler for kind. Register every kind before Run: once Run has started it
// returns ErrStarted. Registering a kind twice is an error. A job whose kind no handler is
// registered for fails its attempt with ErrUnknownKind and is retried.
func (p *Pool) Register(kind string, h Handler) error {
	if kind == "" || h == nil {
		return errors.New("pool: Register needs a kind and a handler")
	}
	p.handlersMu.Lock()
	defer p.handlersMu.Unlock()
	if p.started.Load() {
		return fmt.Errorf("%w: register kind %q before Run", ErrStarted, kind)
	}
	if _, dup := p.handlers[kind]; dup {
		return fmt.Errorf("pool: kind %q registered twice", kind)
	}
	p.handlers[kind] = h
	return nil
}

// Config returns the pool's configuration with defaults filled.
func (p *Pool) Config() Config { return p.cfg }

// Healthy reports whether the last lease renewal statement succeeded. A worker whose renewals
// fail claims nothing until they succeed again; readiness probes can report it.
func (p *Pool) Healthy() bool { return p.keeper.Healthy() }

// ListenerConnected reports whether the LISTEN connection is up.
func (p *Pool) ListenerConnected() bool { return p.listener != nil && p.listener.Connected() }

// Busy returns the number of jobs running now.
func (p *Pool) Busy() int { return int(p.active.Load()) }

// Run works jobs until ctx is cancelled or Shutdown is called. When ctx is cancelled, running
// jobs get Config.ShutdownTimeout to finish before they are cancelled with lease.ErrShutdown and
// handed back. Run returns nil after a stop, also when running jobs had to be cancelled at
// its end (Shutdown's error says so: ErrJobsCancelled).
//
// Before it claims anything, Run checks the database's settings that leash cannot override on
// its connections and fails (wrapping ErrDatabaseSettings, a *SettingError naming the setting
// and the fix) when one stops it: a server in recovery, default_transaction_read_only on,
// session_replication_role other than origin, or a connection limit (the role's, the
// database's, max_connections) below what this worker opens. Ready reports them while they last.
//
// The pool's services (lease renewal, rescue, listener, stall watch, retention, schedules,
// planner statistics) run under one errgroup from start to the very end; the claim loop stops
// first, then running handlers get their grace period, then every outcome is written, and only
// then do the services stop, so that leases are renewed until the last outcome is in.
func (p *Pool) Run(ctx context.Context) error {
	if !p.started.CompareAndSwap(false, true) {
		return errors.New("pool: Run called twice")
	}
	defer close(p.done)
	select {
	case <-p.shutdownCh:
		return nil // shut down before it started: claim nothing
	default:
	}
	ctl, err := p.openControl(ctx)
	if err != nil {
		return err
	}
	if ctl != nil {
		p.ctl.Store(ctl)
		defer ctl.Close()
	}
	if err := p.checkAtStart(ctx); err != nil {
		return err
	}
	if err := p.ensureQueues(ctx); err != nil {
		return err
	}
	p.jobsCtx = context.WithoutCancel(ctx)
	p.runnerLabels = labelsOnly(ctx)

	svcCtx, stopServices := context.WithCancel(context.WithoutCancel(ctx))
	defer stopServices()
	services, svcCtx := errgroup.WithContext(svcCtx)
	rescuer := &leasekeeper.Rescuer{DB: controlDB{p}, Interval: p.cfg.RescueInterval, Logger: p.log, Metrics: &p.metrics.Lease}
	for _, svc := range []func(context.Context){p.keeper.Run, rescuer.Run, p.watchStalls, p.runRetention, p.revocations.run, p.runSchedules, p.runPlannerStats, p.watchSettings,
		func(ctx context.Context) { p.listener.Run(ctx) }} {
		services.Go(func() error { svc(svcCtx); return nil })
	}
	if p.events != nil {
		go p.events.run()
	}
	stopFinisher, finisherDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(finisherDone); p.runFinisher(stopFinisher) }()

	claimCtx, stopClaiming := context.WithCancel(ctx)
	go func() {
		select {
		case <-p.shutdownCh:
		case <-claimCtx.Done():
		}
		stopClaiming()
	}()
	p.log.InfoContext(ctx, "worker started", slog.Any("queues", p.cfg.Queues), slog.Int("concurrency", p.cfg.Concurrency))
	p.claimLoop(claimCtx)
	stopClaiming()

	var grace context.Context
	select {
	case <-p.shutdownCh:
		grace = p.shutdownCtx
	default:
		var cancel context.CancelFunc
		grace, cancel = context.WithTimeout(context.Background(), p.cfg.ShutdownTimeout)
		defer cancel()
	}
	if cancelled, abandoned := p.drain(grace); cancelled > 0 || abandoned > 0 {
		// abandoned counts every handler left running, also one whose lease had ended before the
		// grace period did (a timeout, a revocation), which shutdown did not cancel itself.
		p.stopErr = fmt.Errorf("pool: stopped after %d running jobs were cancelled with lease.ErrShutdown when the grace period ended, and %d handlers that did not return were abandoned, their jobs left to their leases: %w",
			cancelled, abandoned, ErrJobsCancelled)
	}
	p.outcomes.Wait()
	close(stopFinisher)
	<-finisherDone
	if p.events != nil {
		// Shutdown's context bounds the wait too: once it is done, the Observer gets at most
		// ShutdownStallWait more, so a blocked one cannot hold Shutdown for ShutdownTimeout.
		var stop <-chan struct{}
		select {
		case <-p.shutdownCh:
			stop = p.shutdownCtx.Done()
		default:
		}
		if delivered, dropped := p.events.close(p.cfg.ShutdownTimeout, stop, p.cfg.ShutdownStallWait); !delivered {
			p.log.Warn("the Observer did not take the last job events in time; stopping without them",
				slog.Int("dropped", dropped), slog.Duration("shutdown_timeout", p.cfg.ShutdownTimeout))
		}
	}
	stopServices()
	services.Wait()
	p.log.Info("worker stopped")
	return nil
}

// Shutdown stops claiming and waits for running jobs until ctx is done; then it cancels them
// with lease.ErrShutdown and hands their jobs back (available, the attempt not counted) so that
// another worker starts them at once. It returns when Run has returned: nil when every running
// job finished on its own, or an error matching ErrJobsCancelled (and saying how many) when ctx
// ended first and jobs were cancelled, or a handler that did not return was abandoned (also one
// whose lease had ended before, by its timeout or a revocation). A ctx that is already done stops
// at once; after it is done, Run waits at most Config.ShutdownStallWait for handlers that ignore
// cancellation and as long again for the Observer. Only the first call's ctx bounds the wait;
// later calls wait for the same stop and return the same result.
func (p *Pool) Shutdown(ctx context.Context) error {
	p.shutdownOnce.Do(func() {
		p.shutdownCtx = ctx
		close(p.shutdownCh)
	})
	if !p.started.Load() {
		return nil
	}
	<-p.done
	return p.stopErr
}

func (p *Pool) newListener() *listener.Listener {
	cfg := p.cfg.ListenConfig
	if cfg == nil {
		cfg = p.db.Config().ConnConfig
	}
	return &listener.Listener{
		Config:         cfg,
		ReconnectDelay: p.cfg.ListenReconnectDelay,
		PingInterval:   p.cfg.ListenPingInterval,
		Logger:         p.log,
		Metrics:        &p.metrics.Notify,
		Notify: func(ctx context.Context, channel, payload string) error {
			_, err := p.control().Exec(ctx, "SELECT pg_notify($1, $2)", channel, payload)
			return err
		},
		QueryRow: func(ctx context.Context, sql string, args ...any) pgx.Row {
			return p.control().QueryRow(ctx, sql, args...)
		},
		OnAvailable:    p.onAvailable,
		WakeChannel:    p.wakeChannel,
		OnWake:         p.onWake,
		OnRevoked:      p.onRevoked,
		OnQueueChanged: p.onQueueChanged,
		OnConnect: func() {
			p.queues.stale.Store(true)
			// Whatever was sent while disconnected: re-check every lease and look for work.
			p.keeper.Kick(true)
			p.poke(p.wake)
		},
	}
}

func (p *Pool) poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// ensureQueues creates the rows of the pool's queues in leash.queues before the first claim, and
// refuses to start when the pool's role may not use them: claims take a queue only through its
// row (reading it, locking it, which takes the UPDATE privilege, and reading the change hint), so
// the queues would never run. Any other failure (the database not reachable yet, a row another
// client is inserting) is left to the claim loop, which creates missing rows before it claims.
func (p *Pool) ensureQueues(ctx context.Context) error {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var ok bool
	err := p.control().QueryRow(sctx, `
		SELECT pg_catalog.has_table_privilege('leash.queues', 'SELECT')
		   AND pg_catalog.has_table_privilege('leash.queues', 'INSERT')
		   AND pg_catalog.has_any_column_privilege('leash.queues', 'UPDATE')
		   AND pg_catalog.has_sequence_privilege('leash.queue_change_hint', 'SELECT')`).Scan(&ok)
	if err == nil && !ok {
		return fmt.Errorf("pool: the role may not use leash.queues: grant it SELECT, INSERT, UPDATE ON leash.queues " +
			"and SELECT ON SEQUENCE leash.queue_change_hint (docs/sql.md, Privileges)")
	}
	if err := store.EnsureQueues(sctx, p.control(), p.cfg.Queues); err != nil {
		p.log.WarnContext(ctx, "creating the rows of the pool's queues failed; the claim loop tries again", slog.Any("err", err))
	}
	return nil
}
