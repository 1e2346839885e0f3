package store

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
)

// QueueControl is one row of leash.queues: whether the queue is paused and how many of its jobs
// may run at once. A queue without a row is active and uncapped.
type QueueControl struct {
	Name     string
	PausedAt *time.Time
	// MaxRunning is nil when the queue is uncapped.
	MaxRunning *int
	// MaxRunningPerKey is nil when the queue has no per-key limit.
	MaxRunningPerKey *int
	// RateLimit is nil when the queue has no rate limit: else at most this many starts in any
	// window of RatePeriod.
	RateLimit *int
	// RatePeriod is the rate limit's window (one second when the row leaves it NULL).
	RatePeriod time.Duration
	// KeyRateLimit is nil when the queue has no per-key rate limit: else at most this many starts
	// of one key in any window of KeyRatePeriod.
	KeyRateLimit *int
	// KeyRatePeriod is the per-key rate limit's window (one second when the row leaves it NULL).
	KeyRatePeriod time.Duration
}

// Keyed reports whether the queue is claimed key by key: it has a per-key limit or a per-key
// rate limit.
func (q QueueControl) Keyed() bool { return q.MaxRunningPerKey != nil || q.KeyRateLimit != nil }

// ratePeriodMillisSQL reads rate_period and key_rate_period as whole milliseconds (NULL: one
// second), after rate_limit and key_rate_limit.
const ratePeriodMillisSQL = `ceil(extract(epoch FROM coalesce(rate_period, interval '1 second')) * 1000)::bigint,
	key_rate_limit, ceil(extract(epoch FROM coalesce(key_rate_period, interval '1 second')) * 1000)::bigint`

// Paused reports whether the queue is paused.
func (q QueueControl) Paused() bool { return q.PausedAt != nil }

// QueueControls reads the rows of leash.queues for the named queues; queues without a row are
// absent from the map.
func QueueControls(ctx context.Context, db DBTX, names []string) (map[string]QueueControl, error) {
	rows, err := db.Query(ctx, `
		SELECT name, paused_at, max_running, max_running_per_key, rate_limit, `+ratePeriodMillisSQL+` FROM leash.queues WHERE name = ANY($1::text[])`, names)
	if err != nil {
		return nil, fmt.Errorf("read queue controls: %w", err)
	}
	defer rows.Close()
	out := make(map[string]QueueControl)
	for rows.Next() {
		var q QueueControl
		var periodMS, keyPeriodMS int64
		if err := rows.Scan(&q.Name, &q.PausedAt, &q.MaxRunning, &q.MaxRunningPerKey, &q.RateLimit, &periodMS,
			&q.KeyRateLimit, &keyPeriodMS); err != nil {
			return nil, fmt.Errorf("read queue controls: %w", err)
		}
		q.RatePeriod = time.Duration(periodMS) * time.Millisecond
		q.KeyRatePeriod = time.Duration(keyPeriodMS) * time.Millisecond
		out[q.Name] = q
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read queue controls: %w", err)
	}
	return out, nil
}

// PauseQueue pauses the queue (leash.pause_queue): true when it was active.
func PauseQueue(ctx context.Context, db DBTX, name string) (bool, error) {
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.pause_queue($1)`, name).Scan(&changed); err != nil {
		return false, fmt.Errorf("pause queue %q: %w", name, err)
	}
	return changed, nil
}

// ResumeQueue resumes the queue (leash.resume_queue): true when it was paused.
func ResumeQueue(ctx context.Context, db DBTX, name string) (bool, error) {
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.resume_queue($1)`, name).Scan(&changed); err != nil {
		return false, fmt.Errorf("resume queue %q: %w", name, err)
	}
	return changed, nil
}

// SetQueueMaxRunning sets the queue's cap on running jobs across all workers; nil removes it.
// It takes effect at the next claim of every worker.
func SetQueueMaxRunning(ctx context.Context, db DBTX, name string, max *int) error {
	_, err := db.Exec(ctx, `
		INSERT INTO leash.queues AS q (name, max_running) VALUES ($1, $2)
		ON CONFLICT (name) DO UPDATE SET max_running = excluded.max_running, updated_at = now()
		WHERE q.max_running IS DISTINCT FROM excluded.max_running`, name, max)
	if err != nil {
		return fmt.Errorf("set max_running of queue %q: %w", name, err)
	}
	return nil
}

// QueueInfo is one line of the queue list: the queue's control row (if any) and its job counts.
type QueueInfo struct {
	QueueControl
	Available int64 // available or retryable, runnable now or later
	Running   int64
}

// AllQueueControls reads every row of leash.queues, by name.
func AllQueueControls(ctx context.Context, db DBTX) ([]QueueControl, error) {
	rows, err := db.Query(ctx, `SELECT name, paused_at, max_running, max_running_per_key, rate_limit, `+ratePeriodMillisSQL+` FROM leash.queues ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("read queue controls: %w", err)
	}
	defer rows.Close()
	var out []QueueControl
	for rows.Next() {
		var q QueueControl
		var periodMS, keyPeriodMS int64
		if err := rows.Scan(&q.Name, &q.PausedAt, &q.MaxRunning, &q.MaxRunningPerKey, &q.RateLimit, &periodMS,
			&q.KeyRateLimit, &keyPeriodMS); err != nil {
			return nil, fmt.Errorf("read queue controls: %w", err)
		}
		q.RatePeriod = time.Duration(periodMS) * time.Millisecond
		q.KeyRatePeriod = time.Duration(keyPeriodMS) * time.Millisecond
		out = append(out, q)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read queue controls: %w", err)
	}
	return out, nil
}

// ListQueues returns every queue that has a control row or unfinished jobs, by name. The counts
// are read through the partial indexes of queued and running jobs.
func ListQueues(ctx context.Context, db DBTX) ([]QueueInfo, error) {
	controls, err := AllQueueControls(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	rows, err := db.Query(ctx, liveCountsSQL)
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	counts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[StateCount])
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	return MergeQueues(controls, counts), nil
}

// MergeQueues joins queue control rows with live job counts into one list by name.
func MergeQueues(controls []QueueControl, counts []StateCount) []QueueInfo {
	byName := map[string]*QueueInfo{}
	var names []string
	get := func(name string) *QueueInfo {
		if q, ok := byName[name]; ok {
			return q
		}
		q := &QueueInfo{QueueControl: QueueControl{Name: name}}
		byName[name] = q
		names = append(names, name)
		return q
	}
	for _, c := range controls {
		get(c.Name).QueueControl = c
	}
	for _, c := range counts {
		q := get(c.Queue)
		switch c.State {
		case StateAvailable, StateRetryable:
			q.Available += c.Count
		case StateRunning:
			q.Running += c.Count
		}
	}
	sort.Strings(names)
	out := make([]QueueInfo, len(names))
	for i, n := range names {
		out[i] = *byName[n]
	}
	return out
}
