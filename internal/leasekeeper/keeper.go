package leasekeeper

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/internal/store"
)

// Defaults for Config.
const (
	DurationDefault          = 30 * time.Second
	HeartbeatIntervalDefault = 10 * time.Second
)

// Config sets a Keeper's timing. Package pool validates it (pool.Config.Validate), with the
// names of its own fields.
type Config struct {
	// Duration of a lease on the database clock. Default DurationDefault.
	Duration time.Duration
	// HeartbeatInterval between renewals. Must be below Duration/2. Default
	// HeartbeatIntervalDefault.
	HeartbeatInterval time.Duration
	// RetryInterval after a failed renewal. Default HeartbeatInterval/4.
	RetryInterval time.Duration
	// SafetyMargin is subtracted from Duration to get the local trust window, so that a worker
	// stops a job before the database may give it to another. Default Duration/5.
	SafetyMargin time.Duration
}

// WithDefaults fills zero fields with their defaults.
func (c Config) WithDefaults() Config {
	if c.Duration == 0 {
		c.Duration = DurationDefault
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = HeartbeatIntervalDefault
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = c.HeartbeatInterval / 4
	}
	if c.SafetyMargin == 0 {
		c.SafetyMargin = c.Duration / 5
	}
	return c
}

// Metrics counts lease outcomes. All fields are safe for concurrent use.
type Metrics struct {
	RenewalsSucceeded atomic.Int64 // leases renewed
	RenewalsFailed    atomic.Int64 // leases whose renewal statement failed
	RenewalsLost      atomic.Int64 // leases a renewal found gone (revoked or taken over)
	RenewalsSkipped   atomic.Int64 // leases not renewed because another transaction held the row
	EndedRevoked      atomic.Int64 // leases ended by ErrRevoked
	EndedLost         atomic.Int64 // leases ended by ErrLost
	EndedTimeout      atomic.Int64 // leases ended by ErrRenewalTimeout
	EndedShutdown     atomic.Int64 // leases ended by ErrShutdown
	Rescued           atomic.Int64 // expired leases a rescuer took back
	RevokedByRenewal  atomic.Int64 // revocations found by a regular renewal
	RevokedByRecheck  atomic.Int64 // revocations found by a re-check after the listener reconnected
}

func (m *Metrics) countEnd(cause error) {
	switch {
	case errors.Is(cause, ErrRevoked):
		m.EndedRevoked.Add(1)
	case errors.Is(cause, ErrLost):
		m.EndedLost.Add(1)
	case errors.Is(cause, ErrRenewalTimeout):
		m.EndedTimeout.Add(1)
	case errors.Is(cause, ErrShutdown):
		m.EndedShutdown.Add(1)
	}
}

// discard is the logger of a Keeper or Rescuer given none.
var discard = slog.New(slog.DiscardHandler)

// DB runs statements: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx (pool.DB outside).
type DB = store.DBTX

// Keeper renews every lease of one worker in one statement per heartbeat. It keeps no registry
// of its own: it renews what its leases function returns (the worker's running jobs), so that
// each claim is registered in exactly one place.
type Keeper struct {
	// OnEnd, when set before the first Hold, is called once for every lease that ends (with the
	// cause its job's context is cancelled with), on the goroutine that ended it: it must not
	// block.
	OnEnd func(l *Lease, cause error)

	leases  func() []*Lease
	db      DB
	cfg     Config
	log     *slog.Logger
	metrics *Metrics
	kick    chan struct{}
	recheck atomic.Bool // the pending kick is a re-check after a reconnect
	healthy atomic.Bool
	skipped atomic.Bool // the last renewal skipped rows locked by other transactions
}

// NewKeeper returns a Keeper renewing, through db, the leases that leases returns at each
// heartbeat. cfg is filled with defaults and must be valid.
func NewKeeper(db DB, cfg Config, leases func() []*Lease, log *slog.Logger, metrics *Metrics) *Keeper {
	if log == nil {
		log = discard
	}
	if metrics == nil {
		metrics = &Metrics{}
	}
	k := &Keeper{leases: leases, db: db, cfg: cfg.WithDefaults(), log: log, metrics: metrics,
		kick: make(chan struct{}, 1)}
	k.healthy.Store(true)
	return k
}

// Hold makes the lease of a claim made by a statement sent at sentAt (taken before sending, on
// the monotonic clock), its trust timer running. It returns the job's context, derived from
// parent and cancelled with the lease's cause when the lease ends. The caller registers it
// where the Keeper's leases function finds it.
func (k *Keeper) Hold(parent context.Context, jobID, token int64, sentAt time.Time) (context.Context, *Lease) {
	ctx, cancel := context.WithCancelCause(parent)
	window := k.cfg.Duration - k.cfg.SafetyMargin
	l := &Lease{JobID: jobID, Token: token, cancel: cancel, window: window, trustedUntil: sentAt.Add(window),
		onEnd: k.ended}
	// Armed only once assigned, so that expire always sees the timer.
	l.timer = time.AfterFunc(time.Duration(math.MaxInt64), l.expire)
	l.timer.Reset(time.Until(l.trustedUntil))
	return ctx, l
}

// ended counts a lease's end, and logs the one cause nobody else reports: the trust window
// running out.
func (k *Keeper) ended(l *Lease, cause error) {
	k.metrics.countEnd(cause)
	if k.OnEnd != nil {
		k.OnEnd(l, cause)
	}
	if errors.Is(cause, ErrRenewalTimeout) {
		k.log.Warn("lease renewal not confirmed in time; cancelling job before its lease can expire",
			slog.Int64("job_id", l.JobID), slog.Int64("lease_token", l.Token))
	}
}

// Release stops l's trust timer once its outcome is written or its lease is gone (the caller
// unregisters it). The job's context is cancelled, without a cause of its own if the lease had
// none.
func (k *Keeper) Release(l *Lease) {
	l.mu.Lock()
	l.released = true
	l.mu.Unlock()
	l.timer.Stop()
	l.cancel(context.Canceled)
}

// Healthy reports whether the last renewal statement succeeded. A worker whose renewals fail
// should not claim more work.
func (k *Keeper) Healthy() bool { return k.healthy.Load() }

// Kick asks the heartbeat loop to renew (and so re-check) every lease now. recheck marks a kick
// after the listener reconnected and may have missed revocations, for the metrics.
func (k *Keeper) Kick(recheck bool) {
	if recheck {
		k.recheck.Store(true)
	}
	select {
	case k.kick <- struct{}{}:
	default:
	}
}

// Run renews leases every HeartbeatInterval, or every RetryInterval after a failure, until ctx
// is done.
func (k *Keeper) Run(ctx context.Context) {
	t := time.NewTimer(k.cfg.HeartbeatInterval)
	defer t.Stop()
	// Kicks (a reconnect, a takeover notification anyone can forge) renew at most once per
	// minGap: a flood of them costs a few statements a second, not one each.
	minGap := min(k.cfg.RetryInterval, 250*time.Millisecond)
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-k.kick:
			if wait := minGap - time.Since(last); wait > 0 {
				t.Reset(wait)
				continue
			}
		}
		last = time.Now()
		next := k.cfg.HeartbeatInterval
		if err := k.RenewOnce(ctx); err != nil && ctx.Err() == nil {
			k.log.WarnContext(ctx, "lease renewal failed", slog.Any("err", err), slog.Duration("retry_in", k.cfg.RetryInterval))
			next = k.cfg.RetryInterval
		} else if k.skipped.Load() {
			// Some rows were locked by other transactions: try those again soon, before their
			// trust runs out.
			next = k.cfg.RetryInterval
		}
		t.Reset(next)
	}
}

// RenewOnce renews every held lease that has not ended in one statement and ends those the
// database no longer holds for this worker: ErrRevoked when the row was revoked under this
// lease's token, ErrLost otherwise. A lease that has ended (revoked, timed out, shut down) is
// never renewed again: its handler is stopping, and if it does not stop the lease expires and a
// rescuer settles the job. The statement never waits on a row lock and is cut off when no lease
// it carries can be trusted any longer, so a hanging renewal cannot outlive the trust windows.
func (k *Keeper) RenewOnce(ctx context.Context) error {
	leases := k.leases()
	ids, tokens := make([]int64, 0, len(leases)), make([]int64, 0, len(leases))
	live := leases[:0]
	var latest time.Time
	for _, l := range leases {
		if l.Cause() != nil {
			continue
		}
		live = append(live, l)
		ids, tokens = append(ids, l.JobID), append(tokens, l.Token)
		if u := l.trustDeadline(); u.After(latest) {
			latest = u
		}
	}
	k.skipped.Store(false)
	if len(leases) == 0 {
		k.healthy.Store(true)
		return nil
	}
	if len(live) == 0 {
		return nil // nothing to renew; health unknown until a statement runs
	}
	bound := min(k.cfg.HeartbeatInterval, time.Until(latest))
	if bound <= 0 {
		return errors.New("renew leases: every lease's trust window has passed")
	}
	sctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	sentAt := time.Now()
	renewed, err := store.Renew(sctx, k.db, store.RenewParams{IDs: ids, Tokens: tokens, Lease: k.cfg.Duration})
	if err != nil {
		k.healthy.Store(false)
		k.metrics.RenewalsFailed.Add(int64(len(live)))
		return err
	}
	k.healthy.Store(true)
	k.metrics.RenewalsSucceeded.Add(int64(len(renewed)))
	recheck := k.recheck.Swap(false)
	ok := make(map[int64]bool, len(renewed))
	for _, token := range renewed {
		ok[token] = true
	}
	var missing []*Lease
	for _, l := range live {
		if ok[l.Token] {
			l.confirm(sentAt)
		} else if !l.finishing.Load() && l.Cause() == nil {
			missing = append(missing, l)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return k.settleMissing(sctx, missing, recheck)
}

func (k *Keeper) settleMissing(ctx context.Context, missing []*Lease, recheck bool) error {
	ids := make([]int64, len(missing))
	for i, l := range missing {
		ids[i] = l.JobID
	}
	rows, err := store.LeaseStates(ctx, k.db, ids)
	if err != nil {
		// Unknown why: leave them to the next renewal (or the trust window).
		return err
	}
	byID := make(map[int64]store.LeaseState, len(rows))
	for _, r := range rows {
		byID[r.ID] = r
	}
	for _, l := range missing {
		if l.finishing.Load() {
			continue
		}
		row, found := byID[l.JobID]
		ours := found && row.Token != nil && *row.Token == l.Token
		cause := ErrLost
		switch {
		case ours && row.Revoked && row.RevokeReason != nil && *row.RevokeReason != "":
			cause = &RevokedError{Reason: clean.Text(*row.RevokeReason, store.MaxReasonBytes)}
		case ours && row.Revoked:
			cause = ErrRevoked
		case ours:
			// Still ours and not revoked: the row was locked by another transaction (or changed
			// under this statement). Not renewed, not lost: try again soon.
			k.skipped.Store(true)
			k.metrics.RenewalsSkipped.Add(1)
			continue
		}
		k.metrics.RenewalsLost.Add(1)
		if l.End(cause) {
			if errors.Is(cause, ErrRevoked) && recheck {
				k.metrics.RevokedByRecheck.Add(1)
			} else if errors.Is(cause, ErrRevoked) {
				k.metrics.RevokedByRenewal.Add(1)
			}
			attrs := []any{slog.Int64("job_id", l.JobID), slog.Int64("lease_token", l.Token), slog.String("cause", cause.Error())}
			if found {
				attrs = append(attrs, slog.String("state", row.State))
			}
			k.log.WarnContext(ctx, "lease not renewed; cancelling job", attrs...)
		}
	}
	return nil
}
