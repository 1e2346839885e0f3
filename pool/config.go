package pool

import (
	"cmp"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/leasekeeper"
)

// Defaults for Config fields left zero.
const (
	ConcurrencyDefault     = 100
	QueueDefault           = "default"
	PollIntervalDefault    = time.Second
	ShutdownTimeoutDefault = 30 * time.Second
	ControlConnsDefault    = 4
	// MaxTimeout is the longest timeout a job or a kind may have (the table's limit).
	MaxTimeout               = 100 * 24 * time.Hour
	MaxAttemptsDefault       = 20
	LeaseDurationDefault     = 30 * time.Second
	HeartbeatIntervalDefault = 10 * time.Second
)

// Config configures a Pool. Every field has a working default; New fills and validates it.
type Config struct {
	// ID names this worker in leased_by. Default "hostname-pid".
	ID string
	// Queues to work. Default ["default"].
	Queues []string
	// Concurrency is the number of jobs run at once. Default ConcurrencyDefault (100).
	Concurrency int
	// LeaseDuration is how long a claim holds without renewal (database clock). Default 30s.
	LeaseDuration time.Duration
	// HeartbeatInterval between lease renewals; at most LeaseDuration/2. Default 10s.
	HeartbeatInterval time.Duration
	// RenewRetryInterval after a failed renewal. Default HeartbeatInterval/4.
	RenewRetryInterval time.Duration
	// LeaseSafetyMargin is how long before its lease could expire a worker stops trusting it
	// when renewals are not confirmed. Default LeaseDuration/5.
	LeaseSafetyMargin time.Duration
	// RescueInterval between passes that take back expired leases. Default HeartbeatInterval.
	RescueInterval time.Duration
	// PollInterval between claim attempts when no notification arrives (jittered between 80% and
	// 100% of it, never longer). Each poll also makes the next claim start from the front of the
	// queue, so that no runnable job waits behind the claim cursor longer than PollInterval (plus
	// that claim's own time). Default 1s.
	PollInterval time.Duration
	// ShutdownTimeout is the grace period running jobs get when Run's context is cancelled.
	// Default 30s.
	ShutdownTimeout time.Duration
	// StallInterval is how often handlers that ignore their cancelled context are logged.
	// Default LeaseDuration.
	StallInterval time.Duration
	// ShutdownStallWait is how long, after the grace period, handlers cancelled with
	// lease.ErrShutdown get to return before the pool stops without them (their jobs are left
	// to their leases). Default 1s.
	ShutdownStallWait time.Duration
	// Timeouts gives kinds a default time limit for one attempt, for jobs whose timeout column is
	// NULL. Past it the handler's context is cancelled with ErrTimeout and the attempt fails like
	// an error. Kinds not listed have no limit.
	Timeouts map[string]time.Duration
	// ControlConns is the number of connections the pool opens for itself (claims, renewals,
	// outcomes, rescue, retention), from db's configuration, so that handlers using db can never
	// starve the lease protocol; their sessions run with leash's own settings (search_path,
	// isolation, timeouts: docs/operations.md, Database settings), whatever the database's defaults.
	// Default ControlConnsDefault (4); negative shares db instead, whose settings leash leaves
	// alone.
	ControlConns int
	// RetryBackoff gives the delay before attempt+1 after attempt failed. Default
	// DefaultRetryBackoff.
	RetryBackoff func(attempt int) time.Duration
	// ListenConfig is the connection for LISTEN, for deployments whose pool goes through a
	// transaction pooler. Default: the pool's own connection config.
	ListenConfig *pgx.ConnConfig
	// ListenReconnectDelay between listener connection attempts. Default 2s.
	ListenReconnectDelay time.Duration
	// ListenPingInterval is how often the listener proves itself alive with a self-notification.
	// Default 10s; negative disables.
	ListenPingInterval time.Duration
	// RevokeRequireRow makes a bare job_revoked notification (no token) count only when the
	// job's row says it is revoked, since anyone who can connect may NOTIFY. Default false.
	RevokeRequireRow bool
	// RetainCompleted is how long completed jobs are kept before deletion. Default 24h;
	// negative keeps them forever.
	RetainCompleted time.Duration
	// RetainFailed is how long failed and cancelled jobs are kept. Default 7 days; negative
	// keeps them forever.
	RetainFailed time.Duration
	// RetentionInterval between deletion passes. Default 1m.
	RetentionInterval time.Duration
	// Schedules are stored in leash.schedules when Run starts (added, or updated by name; a
	// schedule not listed here is left alone, so schedules can also be managed with
	// UpsertSchedule or `worker schedule`). New checks them: a bad spec fails it.
	Schedules []Schedule
	// ScheduleInterval is the longest this worker goes without checking for due schedules (it
	// also wakes when the earliest one is due). Default 1s; negative: this worker never
	// enqueues scheduled jobs (others do).
	ScheduleInterval time.Duration
	// PlannerStatsInterval is how often this worker checks whether leash.jobs has grown to more
	// than twice the size its planner statistics record, and then analyzes it (one worker at a
	// time), so that prepared statements are planned again for the table's size rather than
	// waiting for autovacuum. Default 1s; negative: never (autovacuum alone).
	PlannerStatsInterval time.Duration
	// Logger receives the pool's logs. Default: discard.
	Logger *slog.Logger
	// Observer, when set, is told about each job as it finishes (for metrics).
	Observer Observer
	// Hooks wrap every attempt, in order (the first one's context is the outermost): tracing
	// (module github.com/leashq/leash/otel) plugs in here. Default none.
	Hooks []AttemptHook

	// Engine holds the claim loop's and the finisher's internal knobs. The defaults suit every
	// workload measured; leave it zero unless a measurement of your own says otherwise.
	Engine EngineConfig
}

// EngineConfig holds knobs of the claim loop and the finisher that exist to measure alternatives
// (docs/performance.md and the bench module compare them), not settings an
// operator needs. Every
// field's zero value is its default.
type EngineConfig struct {
	// IdlePollInterval is how often a worker that just ran out of work claims again, until it
	// has found nothing for WaitAfter; at most Config.PollInterval. Default
	// IdlePollIntervalDefault (1ms).
	IdlePollInterval time.Duration
	// WaitAfter is how long a worker finds nothing before it registers as waiting, so that
	// inserts wake it with a notification. Busy workers are not registered: inserts into their
	// queues send no notification and commit without waiting on each other. Default
	// WaitAfterDefault (5ms), at most 1m.
	WaitAfter time.Duration
	// FinishFlushInterval is the longest a finished job's outcome waits to be written with
	// others. Default FinishFlushDefault (2ms), at most 1s.
	FinishFlushInterval time.Duration
	// OutcomesWithClaims writes outcomes that are waiting when a claim is due in the claim's own
	// transaction (one pipelined round trip and one commit for both) instead of leaving them to
	// the finisher, which by default commits them beside the claims on a connection of its own.
	// Default false.
	OutcomesWithClaims bool
	// ClaimsInFlight is how many claims a worker keeps in flight at once while work flows, each
	// for its share of the slots, each on a control connection of its own: while one claim
	// commits, the next one already runs. A worker looking for work, or one serving a capped
	// queue, claims one at a time. More than 1 needs Config.ControlConns of at least
	// ClaimsInFlight+2 (room for renewals and outcomes). Default ClaimsInFlightDefault (1), at
	// most 4.
	ClaimsInFlight int
	// ClaimGather is how long a worker whose last claim took every slot it asked for (jobs are
	// waiting) lets slots free up before it claims again, unless every slot (its share, with
	// ClaimsInFlight above 1) is free by then: one claim and one commit then take many jobs
	// rather than each few. While a handler holds a slot for long, every such claim waits the
	// whole ClaimGather. Default ClaimGatherDefault (1ms), at most 1s; negative claims as soon
	// as one slot frees.
	ClaimGather time.Duration
	// ClaimFromFront makes every claim scan its queue's index from the front. By default a
	// worker serving one queue starts each claim past the last job it claimed (looking again at
	// what the last 100ms of claims passed over) and goes back to the front regularly (at least
	// every 10ms, and more rarely only while a claim from the front is slow, but at least once
	// per Config.PollInterval): an old snapshot held open elsewhere (a long report, a forgotten
	// BEGIN) keeps the index entries of every claimed job from vacuum, and claims from the front
	// would walk all of them. The cost: a job that becomes runnable further ahead of the last
	// claimed one (a higher priority, a run_at in the past) waits for the next claim from the
	// front, at most a poll interval. Default false.
	ClaimFromFront bool
}

// Defaults for EngineConfig fields left zero.
const (
	IdlePollIntervalDefault = time.Millisecond
	WaitAfterDefault        = 5 * time.Millisecond
	ClaimsInFlightDefault   = 1
	ClaimGatherDefault      = time.Millisecond
	FinishFlushDefault      = 2 * time.Millisecond
)

// finishBatch is the most outcomes one statement writes.
const finishBatch = 1000

// ConfigError names the Config field that broke a rule.
type ConfigError struct {
	Field string
	Rule  string
}

// Error names the field and the rule.
func (e *ConfigError) Error() string { return fmt.Sprintf("invalid config: %s %s", e.Field, e.Rule) }

// DefaultRetryBackoff waits 2^(attempt-1) seconds, capped at six hours, plus up to 25% jitter.
func DefaultRetryBackoff(attempt int) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	d := 6 * time.Hour
	if attempt <= 15 {
		d = min(time.Duration(1<<(attempt-1))*time.Second, d)
	}
	return d + time.Duration(rand.Int64N(int64(d)/4+1))
}

func (c Config) withDefaults() Config {
	if c.ID == "" {
		host, _ := os.Hostname()
		c.ID = host + "-" + strconv.Itoa(os.Getpid())
	}
	if len(c.Queues) == 0 {
		c.Queues = []string{QueueDefault}
	}
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	lc := c.leaseConfig().WithDefaults()
	c.LeaseDuration, c.HeartbeatInterval, c.RenewRetryInterval, c.LeaseSafetyMargin =
		lc.Duration, lc.HeartbeatInterval, lc.RetryInterval, lc.SafetyMargin
	c.RescueInterval = cmp.Or(c.RescueInterval, c.HeartbeatInterval)
	c.PollInterval = cmp.Or(c.PollInterval, PollIntervalDefault)
	c.Engine.IdlePollInterval = cmp.Or(c.Engine.IdlePollInterval, IdlePollIntervalDefault)
	c.Engine.ClaimsInFlight = cmp.Or(c.Engine.ClaimsInFlight, ClaimsInFlightDefault)
	c.Engine.ClaimGather = cmp.Or(c.Engine.ClaimGather, ClaimGatherDefault)
	c.Engine.WaitAfter = cmp.Or(c.Engine.WaitAfter, WaitAfterDefault)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, ShutdownTimeoutDefault)
	c.Engine.FinishFlushInterval = cmp.Or(c.Engine.FinishFlushInterval, FinishFlushDefault)
	c.StallInterval = cmp.Or(c.StallInterval, c.LeaseDuration)
	c.ShutdownStallWait = cmp.Or(c.ShutdownStallWait, time.Second)
	c.ControlConns = cmp.Or(c.ControlConns, ControlConnsDefault)
	c.RetainCompleted = cmp.Or(c.RetainCompleted, RetainCompletedDefault)
	c.RetainFailed = cmp.Or(c.RetainFailed, RetainFailedDefault)
	c.RetentionInterval = cmp.Or(c.RetentionInterval, RetentionIntervalDefault)
	c.ScheduleInterval = cmp.Or(c.ScheduleInterval, ScheduleIntervalDefault)
	c.PlannerStatsInterval = cmp.Or(c.PlannerStatsInterval, PlannerStatsIntervalDefault)
	if c.RetryBackoff == nil {
		c.RetryBackoff = DefaultRetryBackoff
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) leaseConfig() leasekeeper.Config {
	return leasekeeper.Config{Duration: c.LeaseDuration, HeartbeatInterval: c.HeartbeatInterval,
		RetryInterval: c.RenewRetryInterval, SafetyMargin: c.LeaseSafetyMargin}
}

// WithDefaults returns c with every zero field set to its default, as New uses it.
func (c Config) WithDefaults() Config { return c.withDefaults() }

// Validate reports the first field that breaks a rule, as a *ConfigError, checking c as New
// would use it: a zero field counts as its default. It does not change c (see WithDefaults).
func (c Config) Validate() error {
	c = c.withDefaults()
	bad := func(field, rule string, args ...any) error {
		return &ConfigError{Field: field, Rule: fmt.Sprintf(rule, args...)}
	}
	switch {
	case c.LeaseDuration < 100*time.Millisecond:
		return bad("LeaseDuration", "must be at least 100ms, got %s", c.LeaseDuration)
	case c.HeartbeatInterval <= 0:
		return bad("HeartbeatInterval", "must be positive, got %s", c.HeartbeatInterval)
	case c.HeartbeatInterval*2 > c.LeaseDuration:
		return bad("HeartbeatInterval", "%s must be at most half of LeaseDuration (%s), so that a renewal can be retried and still land before the lease expires", c.HeartbeatInterval, c.LeaseDuration)
	case c.RenewRetryInterval <= 0 || c.RenewRetryInterval > c.HeartbeatInterval:
		return bad("RenewRetryInterval", "%s must be positive and at most HeartbeatInterval (%s)", c.RenewRetryInterval, c.HeartbeatInterval)
	case c.LeaseSafetyMargin <= 0 || c.LeaseSafetyMargin >= c.LeaseDuration-c.HeartbeatInterval:
		return bad("LeaseSafetyMargin", "%s must be positive and below LeaseDuration minus HeartbeatInterval (%s)", c.LeaseSafetyMargin, c.LeaseDuration-c.HeartbeatInterval)
	case len(c.ID) > 200:
		return bad("ID", "must be at most 200 characters")
	case c.Concurrency < 1 || c.Concurrency > 100000:
		return bad("Concurrency", "must be between 1 and 100000, got %d", c.Concurrency)
	case c.PollInterval < 10*time.Millisecond:
		return bad("PollInterval", "must be at least 10ms, got %s", c.PollInterval)
	case c.Engine.IdlePollInterval < time.Millisecond || c.Engine.IdlePollInterval > c.PollInterval:
		return bad("Engine.IdlePollInterval", "must be between 1ms and PollInterval (%s), got %s", c.PollInterval, c.Engine.IdlePollInterval)
	case c.Engine.ClaimsInFlight < 1 || c.Engine.ClaimsInFlight > 4:
		return bad("Engine.ClaimsInFlight", "must be between 1 and 4, got %d", c.Engine.ClaimsInFlight)
	case c.Engine.ClaimsInFlight > 1 && c.ControlConns > 0 && c.ControlConns < c.Engine.ClaimsInFlight+2:
		return bad("Engine.ClaimsInFlight", "of %d needs ControlConns of at least %d (room for renewals and outcomes), got %d",
			c.Engine.ClaimsInFlight, c.Engine.ClaimsInFlight+2, c.ControlConns)
	case c.Engine.ClaimGather > time.Second:
		return bad("Engine.ClaimGather", "must be at most 1s, got %s", c.Engine.ClaimGather)
	case c.Engine.WaitAfter < 0 || c.Engine.WaitAfter > time.Minute:
		return bad("Engine.WaitAfter", "must be between 0 and 1m, got %s", c.Engine.WaitAfter)
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", "must not be negative, got %s", c.ShutdownTimeout)
	case c.Engine.FinishFlushInterval < 0 || c.Engine.FinishFlushInterval > time.Second:
		return bad("Engine.FinishFlushInterval", "must be between 0 and 1s, got %s", c.Engine.FinishFlushInterval)
	case c.RetentionInterval < 10*time.Millisecond:
		return bad("RetentionInterval", "must be at least 10ms, got %s", c.RetentionInterval)
	case c.RescueInterval < 10*time.Millisecond:
		return bad("RescueInterval", "must be at least 10ms, got %s", c.RescueInterval)
	case c.ShutdownStallWait < 0:
		return bad("ShutdownStallWait", "must not be negative, got %s", c.ShutdownStallWait)
	case c.ScheduleInterval > 0 && c.ScheduleInterval < 10*time.Millisecond:
		return bad("ScheduleInterval", "must be at least 10ms (or negative to turn schedules off), got %s", c.ScheduleInterval)
	case c.PlannerStatsInterval > 0 && c.PlannerStatsInterval < 10*time.Millisecond:
		return bad("PlannerStatsInterval", "must be at least 10ms (or negative to leave it to autovacuum), got %s", c.PlannerStatsInterval)
	case c.ControlConns > 100:
		return bad("ControlConns", "must be at most 100, got %d", c.ControlConns)
	case !validName(c.ID):
		return bad("ID", "must be valid UTF-8 without NUL bytes")
	}
	for i, s := range c.Schedules {
		if _, err := s.row(); err != nil {
			return bad("Schedules", "[%d]: %v", i, err)
		}
	}
	for kind, d := range c.Timeouts {
		if d < time.Millisecond || d > MaxTimeout {
			return bad("Timeouts", "must hold durations between 1ms and %s, got %s for kind %q", MaxTimeout, d, kind)
		}
	}
	for _, q := range c.Queues {
		if q == "" || utf8.RuneCountInString(q) > 128 || !validName(q) {
			return bad("Queues", "must hold names of 1 to 128 characters, got %q", q)
		}
	}
	return nil
}
