package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leashq/leash/internal/store"
)

// Defaults for Config.
const (
	DurationDefault          = 30 * time.Second
	HeartbeatIntervalDefault = 10 * time.Second
)

// Config sets a Keeper's timing.
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

// Validate reports the first rule the (filled) timing breaks. Names are the Config fields;
// callers with other names (environment variables) map them.
func (c Config) Validate() error {
	switch {
	case c.Duration < 100*time.Millisecond:
		return errors.New("duration: must be at least 100ms")
	case c.HeartbeatInterval <= 0:
		return errors.New("heartbeat interval: must be positive")
	case c.HeartbeatInterval*2 > c.Duration:
		return fmt.Errorf("heartbeat interval: %s must be at most half of the lease duration (%s), so that a renewal can fail once and still land before the lease expires", c.HeartbeatInterval, c.Duration)
	case c.RetryInterval <= 0 || c.RetryInterval > c.HeartbeatInterval:
		return fmt.Errorf("retry interval: %s must be positive and at most the heartbeat interval (%s)", c.RetryInterval, c.HeartbeatInterval)
	case c.SafetyMargin <= 0 || c.SafetyMargin >= c.Duration-c.HeartbeatInterval:
		return fmt.Errorf("safety margin: %s must be positive and below the lease duration minus the heartbeat interval (%s)", c.SafetyMargin, c.Duration-c.HeartbeatInterval)
	}
	return nil
}

// Metrics counts lease outcomes. All fields are safe for concurrent use.
type Metrics struct {
	RenewalsSucceeded atomic.Int64 // leases renewed
	RenewalsFailed    atomic.Int64 // leases whose renewal statement failed
	RenewalsLost      atomic.Int64 // leases a renewal found gone (revoked or taken over)
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

// Keeper holds every lease of one worker and renews them all in one statement per heartbeat.
type Keeper struct {
	db      store.DBTX
	cfg     Config
	log     *slog.Logger
	metrics *Metrics
	kick    chan struct{}
	recheck atomic.Bool // the pending kick is a re-check after a reconnect
	healthy atomic.Bool

	mu   sync.Mutex
	held map[int64]*Lease
}

// NewKeeper returns a Keeper renewing through db. cfg is filled with defaults and must be valid.
func NewKeeper(db store.DBTX, cfg Config, log *slog.Logger, metrics *Metrics) *Keeper {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if metrics == nil {
		metrics = &Metrics{}
	}
	k := &Keeper{db: db, cfg: cfg.WithDefaults(), log: log, metrics: metrics,
		kick: make(chan struct{}, 1), held: map[int64]*Lease{}}
	k.healthy.Store(true)
	return k
}

// Hold starts supervising a claim made by a statement sent at sentAt (taken before sending, on
// the monotonic clock). It returns the job's context, derived from parent and cancelled with the
// lease's cause when the lease ends.
func (k *Keeper) Hold(parent context.Context, jobID, token int64, sentAt time.Time) (context.Context, *Lease) {
	ctx, cancel := context.WithCancelCause(parent)
	window := k.cfg.Duration - k.cfg.SafetyMargin
	l := &Lease{JobID: jobID, Token: token, cancel: cancel, window: window, trustedUntil: sentAt.Add(window),
		onEnd: k.ended}
	// Armed only once assigned, so that expire always sees the timer.
	l.timer = time.AfterFunc(time.Duration(math.MaxInt64), l.expire)
	l.timer.Reset(time.Until(l.trustedUntil))
	k.mu.Lock()
	k.held[jobID] = l
	k.mu.Unlock()
	return ctx, l
}

// ended counts a lease's end, and logs the one cause nobody else reports: the trust window
// running out.
func (k *Keeper) ended(l *Lease, cause error) {
	k.metrics.countEnd(cause)
	if errors.Is(cause, ErrRenewalTimeout) {
		k.log.Warn("lease renewal not confirmed in time; cancelling job before its lease can expire",
			slog.Int64("job_id", l.JobID), slog.Int64("lease_token", l.Token))
	}
}

// Release stops supervising l (its outcome is written or its lease is gone). The job's context
// is cancelled, without a cause of its own if the lease had none.
func (k *Keeper) Release(l *Lease) {
	k.mu.Lock()
	if k.held[l.JobID] == l {
		delete(k.held, l.JobID)
	}
	k.mu.Unlock()
	l.timer.Stop()
	l.cancel(context.Canceled)
}

// Get returns the lease held on job id, or nil.
func (k *Keeper) Get(id int64) *Lease {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.held[id]
}

// Held returns the leases currently held.
func (k *Keeper) Held() []*Lease {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make([]*Lease, 0, len(k.held))
	for _, l := range k.held {
		out = append(out, l)
	}
	return out
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
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-k.kick:
		}
		next := k.cfg.HeartbeatInterval
		if err := k.RenewOnce(ctx); err != nil && ctx.Err() == nil {
			k.log.WarnContext(ctx, "lease renewal failed", slog.Any("err", err), slog.Duration("retry_in", k.cfg.RetryInterval))
			next = k.cfg.RetryInterval
		}
		t.Reset(next)
	}
}

// RenewOnce renews every held lease in one statement and ends those the database no longer
// holds for this worker: ErrRevoked when the row was revoked under this lease's token, ErrLost
// otherwise.
func (k *Keeper) RenewOnce(ctx context.Context) error {
	leases := k.Held()
	if len(leases) == 0 {
		k.healthy.Store(true)
		return nil
	}
	ids, tokens := make([]int64, len(leases)), make([]int64, len(leases))
	for i, l := range leases {
		ids[i], tokens[i] = l.JobID, l.Token
	}
	sctx, cancel := context.WithTimeout(ctx, k.cfg.HeartbeatInterval)
	defer cancel()
	sentAt := time.Now()
	renewed, err := store.Renew(sctx, k.db, store.RenewParams{IDs: ids, Tokens: tokens, Lease: k.cfg.Duration})
	if err != nil {
		k.healthy.Store(false)
		k.metrics.RenewalsFailed.Add(int64(len(leases)))
		return err
	}
	k.healthy.Store(true)
	k.metrics.RenewalsSucceeded.Add(int64(len(renewed)))
	recheck := k.recheck.Swap(false)
	ok := make(map[int64]bool, len(renewed))
	for _, id := range renewed {
		ok[id] = true
	}
	var missing []*Lease
	for _, l := range leases {
		if ok[l.JobID] {
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
		case ours && row.Revoked:
			cause = ErrRevoked
		case ours:
			continue // still ours and not revoked: a race with this statement; next tick decides
		}
		k.metrics.RenewalsLost.Add(1)
		if l.End(cause) {
			if cause == ErrRevoked && recheck {
				k.metrics.RevokedByRecheck.Add(1)
			} else if cause == ErrRevoked {
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
