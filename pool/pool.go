// Package pool is what an application imports to run leash: enqueue jobs (Insert, InsertTx,
// InsertMany), register handlers by kind, and run a Pool that claims jobs into a bounded set of
// goroutines, keeps each on a lease (package lease), and writes every outcome fenced by the
// claim's token.
package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/notify"
)

// Metrics counts what a Pool did. All fields are safe for concurrent use.
type Metrics struct {
	Lease  lease.Metrics
	Notify notify.Metrics

	Claimed     atomic.Int64
	Completed   atomic.Int64
	Retried     atomic.Int64
	Failed      atomic.Int64
	Cancelled   atomic.Int64
	HandedBack  atomic.Int64
	StaleWrites atomic.Int64 // outcomes and writes rejected by the lease fence
	Panics      atomic.Int64
	Stalled     atomic.Int64 // handlers running on after their lease ended, at the last check
	Pruned      atomic.Int64 // finished jobs deleted by retention
	// Revocations by how they arrived.
	RevokedByNotification atomic.Int64
	RevokedByRenewal      atomic.Int64
}

func (m *Metrics) count(state string) {
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
	db      *pgxpool.Pool
	cfg     Config
	log     *slog.Logger
	metrics *Metrics
	keeper  *lease.Keeper

	handlersMu sync.RWMutex
	handlers   map[string]Handler

	listener *notify.Listener
	startObs StartObserver // Config.Observer, when it also wants starts
	wake     chan struct{} // a notification or a poll: there may be new jobs
	slotWake chan struct{} // a handler returned: a slot is free
	active   atomic.Int64
	group    errgroup.Group
	jobsCtx  context.Context

	finishCh     chan finishItem
	finisherDone chan struct{}

	runningMu sync.Mutex
	running   map[int64]*Job

	started      atomic.Bool
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
		db: db, cfg: cfg, log: cfg.Logger.With(slog.String("worker", cfg.ID)), metrics: &Metrics{},
		handlers: map[string]Handler{}, wake: make(chan struct{}, 1), slotWake: make(chan struct{}, 1),
		finishCh: make(chan finishItem, 4*cfg.Concurrency+16), finisherDone: make(chan struct{}),
		running: map[int64]*Job{}, shutdownCh: make(chan struct{}), done: make(chan struct{}),
	}
	p.startObs, _ = cfg.Observer.(StartObserver)
	p.keeper = lease.NewKeeper(db, cfg.leaseConfig(), p.log, &p.metrics.Lease)
	p.group.SetLimit(cfg.Concurrency)
	p.listener = p.newListener()
	return p, nil
}

// Register sets the handler for kind. Register before Run; registering a kind twice is an error.
func (p *Pool) Register(kind string, h Handler) error {
	if kind == "" || h == nil {
		return errors.New("pool: Register needs a kind and a handler")
	}
	p.handlersMu.Lock()
	defer p.handlersMu.Unlock()
	if _, dup := p.handlers[kind]; dup {
		return fmt.Errorf("pool: kind %q registered twice", kind)
	}
	p.handlers[kind] = h
	return nil
}

// Config returns the pool's configuration with defaults filled.
func (p *Pool) Config() Config { return p.cfg }

// Metrics returns the pool's live counters.
func (p *Pool) Metrics() *Metrics { return p.metrics }

// Keeper returns the pool's lease keeper.
func (p *Pool) Keeper() *lease.Keeper { return p.keeper }

// ListenerConnected reports whether the LISTEN connection is up.
func (p *Pool) ListenerConnected() bool { return p.listener != nil && p.listener.Connected() }

// Busy returns the number of jobs running now.
func (p *Pool) Busy() int { return int(p.active.Load()) }

// Run works jobs until ctx is cancelled or Shutdown is called. When ctx is cancelled, running
// jobs get Config.ShutdownTimeout to finish before they are cancelled with lease.ErrShutdown and
// handed back. Run returns nil after a clean stop.
func (p *Pool) Run(ctx context.Context) error {
	if !p.started.CompareAndSwap(false, true) {
		return errors.New("pool: Run called twice")
	}
	defer close(p.done)
	loops, stopLoops := context.WithCancel(context.WithoutCancel(ctx))
	defer stopLoops()
	p.jobsCtx = context.WithoutCancel(ctx)

	var wg sync.WaitGroup
	goLoop := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	stopFinisher := make(chan struct{})
	go p.runFinisher(stopFinisher)
	goLoop(func() { p.keeper.Run(loops) })
	rescuer := &lease.Rescuer{DB: p.db, Interval: p.cfg.RescueInterval, Logger: p.log, Metrics: &p.metrics.Lease}
	goLoop(func() { rescuer.Run(loops) })
	goLoop(func() { p.watchStalls(loops) })
	goLoop(func() { p.runRetention(loops) })
	goLoop(func() { p.listener.Run(loops) })

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
	p.drain(grace)
	close(stopFinisher)
	<-p.finisherDone
	stopLoops()
	wg.Wait()
	p.log.Info("worker stopped")
	return nil
}

// Shutdown stops claiming and waits for running jobs until ctx is done; then it cancels them
// with lease.ErrShutdown and hands their jobs back (available, the attempt not counted) so that
// another worker starts them at once. It returns when Run has returned. A ctx that is already
// done stops at once.
func (p *Pool) Shutdown(ctx context.Context) error {
	p.shutdownOnce.Do(func() {
		p.shutdownCtx = ctx
		close(p.shutdownCh)
	})
	if !p.started.Load() {
		return nil
	}
	<-p.done
	return nil
}

func (p *Pool) newListener() *notify.Listener {
	cfg := p.cfg.ListenConfig
	if cfg == nil {
		cfg = p.db.Config().ConnConfig
	}
	return &notify.Listener{
		Config:         cfg,
		ReconnectDelay: p.cfg.ListenReconnectDelay,
		PingInterval:   p.cfg.ListenPingInterval,
		Logger:         p.log,
		Metrics:        &p.metrics.Notify,
		Notify: func(ctx context.Context, channel, payload string) error {
			_, err := p.db.Exec(ctx, "SELECT pg_notify($1, $2)", channel, payload)
			return err
		},
		OnAvailable: func(queue string) {
			for _, q := range p.cfg.Queues {
				if q == queue {
					p.poke(p.wake)
					return
				}
			}
		},
		OnRevoked: p.onRevoked,
		OnConnect: func() {
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

// claimLoop claims up to the number of free slots whenever woken, until ctx is done.
func (p *Pool) claimLoop(ctx context.Context) {
	poll := time.NewTimer(p.jitteredPoll())
	defer poll.Stop()
	moreLikely := true // the last claim filled every slot it asked for
	for {
		free := p.cfg.Concurrency - int(p.active.Load())
		if free > 0 && p.keeper.Healthy() {
			n, err := p.claim(ctx, free)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				p.log.WarnContext(ctx, "claiming jobs failed", slog.Any("err", err))
				moreLikely = false
			} else {
				moreLikely = n == free
				if moreLikely {
					continue
				}
			}
		}
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				return
			case <-p.wake:
				waiting = false
			case <-p.slotWake:
				waiting = !moreLikely
			case <-poll.C:
				poll.Reset(p.jitteredPoll())
				waiting = false
			}
		}
	}
}

func (p *Pool) jitteredPoll() time.Duration {
	d := p.cfg.PollInterval
	return d - d/10 + time.Duration(rand.Int64N(int64(d)/5+1))
}

// claim leases up to limit jobs in one statement and starts them. The statement is not cut short
// by ctx: jobs it claims are always started (and handed back on shutdown), never stranded.
func (p *Pool) claim(ctx context.Context, limit int) (int, error) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	sentAt := time.Now()
	jobs, err := store.Claim(sctx, p.db, store.ClaimParams{Queues: p.cfg.Queues, Limit: limit,
		WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration})
	if err != nil {
		return 0, err
	}
	p.metrics.Claimed.Add(int64(len(jobs)))
	for i := range jobs {
		p.start(&jobs[i], sentAt)
	}
	return len(jobs), nil
}

func (p *Pool) start(cj *store.ClaimedJob, sentAt time.Time) {
	ctx, l := p.keeper.Hold(p.jobsCtx, cj.ID, cj.Token, sentAt)
	j := &Job{ID: cj.ID, Queue: cj.Queue, Kind: cj.Kind, Payload: cj.Payload, Priority: cj.Priority,
		Attempt: int(cj.Attempt), MaxAttempts: int(cj.MaxAttempts), Token: cj.Token, CreatedAt: cj.CreatedAt,
		RunAt: cj.RunAt, AttemptedAt: cj.AttemptedAt, lease: l, db: p.db, started: time.Now()}
	p.runningMu.Lock()
	p.running[j.ID] = j
	p.runningMu.Unlock()
	p.active.Add(1)
	if p.startObs != nil {
		p.startObs.JobStarted(JobEvent{Queue: j.Queue, Kind: j.Kind, State: store.StateRunning, Pickup: j.pickup()})
	}
	p.group.Go(func() error {
		p.execute(ctx, j)
		return nil
	})
}

func (p *Pool) forget(j *Job) {
	p.runningMu.Lock()
	if p.running[j.ID] == j {
		delete(p.running, j.ID)
	}
	p.runningMu.Unlock()
}

// execute runs the handler and queues its outcome. It never returns an error: a failing job is
// not a failing pool.
func (p *Pool) execute(ctx context.Context, j *Job) {
	err := p.call(ctx, j)
	j.lease.MarkFinishing()
	dur := time.Since(j.started)
	p.active.Add(-1)
	p.poke(p.slotWake)
	if !j.settled.CompareAndSwap(false, true) {
		// Handed back during shutdown while this handler ignored its context.
		p.log.Warn("stalled handler returned after its job was handed back; result dropped",
			slog.Int64("job_id", j.ID), slog.Any("err", err))
		return
	}
	out, write := p.outcome(j, err)
	if !write {
		p.observe(j, "", dur, false)
		p.keeper.Release(j.lease)
		p.forget(j)
		return
	}
	p.finishCh <- finishItem{out: out, job: j, dur: dur}
}

func (p *Pool) call(ctx context.Context, j *Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			p.metrics.Panics.Add(1)
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
			p.log.Error("handler panicked", slog.Int64("job_id", j.ID), slog.String("kind", j.Kind), slog.Any("panic", r))
		}
	}()
	p.handlersMu.RLock()
	h, ok := p.handlers[j.Kind]
	p.handlersMu.RUnlock()
	if !ok {
		return Permanent(fmt.Errorf("no handler registered for kind %q on worker %s", j.Kind, p.cfg.ID))
	}
	return h.Handle(ctx, j)
}

// outcome decides what to write for a finished handler; write is false when nothing should be
// (the lease was taken over: the fence would reject it anyway).
func (p *Pool) outcome(j *Job, err error) (store.Outcome, bool) {
	out := store.Outcome{ID: j.ID, Token: j.Token}
	cause := j.lease.Cause()
	if err == nil {
		out.State = store.StateCompleted
		return out, true
	}
	ae := &store.AttemptError{Attempt: int32(j.Attempt), Error: err.Error(), Worker: p.cfg.ID}
	var pe *PanicError
	if errors.As(err, &pe) {
		ae.Stack = pe.Stack
	}
	out.Error = ae
	var ra *retryAfterError
	switch {
	case errors.Is(cause, lease.ErrShutdown):
		out.State, out.Error = store.StateAvailable, nil
	case errors.Is(cause, lease.ErrRevoked):
		out.State = store.StateCancelled
		ae.Error = "revoked: " + err.Error()
		if errors.Is(cause, errRevokedByNotification) {
			out.RevokeReason = revokedByNotificationReason
		}
	case errors.Is(cause, lease.ErrLost):
		p.log.Info("handler stopped after losing its lease", slog.Int64("job_id", j.ID),
			slog.Int64("lease_token", j.Token), slog.Any("err", err))
		return out, false
	case errors.Is(cause, lease.ErrRenewalTimeout):
		// Still fenced: written only if nobody took the job meanwhile.
		out.State = store.StateRetryable
		ae.Error = "lease renewal timed out: " + err.Error()
	case IsPermanent(err) || j.Attempt >= j.MaxAttempts:
		out.State = store.StateFailed
	case errors.As(err, &ra):
		out.State, out.Delay = store.StateRetryable, ra.d
	default:
		out.State, out.Delay = store.StateRetryable, p.cfg.RetryBackoff(j.Attempt)
	}
	if out.State == store.StateRetryable && j.Attempt >= j.MaxAttempts {
		out.State = store.StateFailed
	}
	return out, true
}

func (p *Pool) observe(j *Job, state string, dur time.Duration, stale bool) {
	if p.cfg.Observer == nil {
		return
	}
	p.cfg.Observer.JobFinished(JobEvent{Queue: j.Queue, Kind: j.Kind, State: state, Duration: dur,
		Pickup: j.pickup(), Stale: stale})
}

// drain waits for running handlers until grace is done, then cancels them with ErrShutdown and
// hands back the jobs of handlers that still do not return.
func (p *Pool) drain(grace context.Context) {
	all := make(chan struct{})
	go func() { p.group.Wait(); close(all) }()
	select {
	case <-all:
		return
	case <-grace.Done():
	}
	held := p.keeper.Held()
	if len(held) > 0 {
		p.log.Warn("shutdown grace period over; cancelling running jobs", slog.Int("jobs", len(held)))
	}
	for _, l := range held {
		l.End(lease.ErrShutdown)
	}
	select {
	case <-all:
		return
	case <-time.After(time.Second):
	}
	// Handlers that ignore cancellation: hand their jobs back ourselves.
	p.runningMu.Lock()
	var stalled []*Job
	for _, j := range p.running {
		if !j.lease.Finishing() {
			stalled = append(stalled, j)
		}
	}
	p.runningMu.Unlock()
	for _, j := range stalled {
		if !j.settled.CompareAndSwap(false, true) {
			continue // it returned just now and writes its own outcome
		}
		j.lease.MarkFinishing()
		p.log.Warn("handler ignores cancellation; handing its job back", slog.Int64("job_id", j.ID), slog.String("kind", j.Kind))
		p.finishCh <- finishItem{out: store.Outcome{ID: j.ID, Token: j.Token, State: store.StateAvailable}, job: j}
	}
}

// watchStalls logs, once per StallInterval, handlers that keep running after their lease ended:
// they keep their slot (a goroutine cannot be killed) but can no longer write.
func (p *Pool) watchStalls(ctx context.Context) {
	t := time.NewTicker(p.cfg.StallInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		var n int64
		p.runningMu.Lock()
		for _, j := range p.running {
			cause := j.lease.Cause()
			if cause == nil || j.lease.Finishing() {
				continue
			}
			if j.stallSeen.IsZero() {
				j.stallSeen = now
				continue
			}
			n++
			p.log.Warn("handler still running after its lease ended; it holds a slot but cannot write",
				slog.Int64("job_id", j.ID), slog.String("kind", j.Kind), slog.Any("cause", cause),
				slog.Duration("since", now.Sub(j.stallSeen)))
		}
		p.runningMu.Unlock()
		p.metrics.Stalled.Store(n)
	}
}
