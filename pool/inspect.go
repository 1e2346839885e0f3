package pool

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/store"
)

// Reading and operating on jobs from outside a handler: what an admin page, a CLI or an
// application's own support tooling needs. Every function takes the database to use (a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx) and reads the rows as they are; none needs a running
// Pool.

// The states of a job (leash.jobs.state).
const (
	StatePending   = "pending"   // in a workflow, waiting for its dependencies to complete
	StateAvailable = "available" // waiting to run (run_at may be in the future)
	StateRunning   = "running"   // under a lease
	StateRetryable = "retryable" // failed an attempt, waiting for the next
	StateCompleted = "completed" // finished: done
	StateFailed    = "failed"    // finished: attempts used up or failed permanently
	StateCancelled = "cancelled" // finished: revoked or cancelled
)

// States lists every job state, queued ones first.
func States() []string {
	return []string{StatePending, StateAvailable, StateRunning, StateRetryable, StateCompleted, StateFailed, StateCancelled}
}

// ErrJobNotFound: no job has the id asked for (it never existed or retention deleted it).
var ErrJobNotFound = errors.New("job not found")

// JobRow is every column of one job, as stored. JSON columns come pretty-printed; durations are
// measured on the database clock when the row was read.
type JobRow struct {
	ID          int64
	Queue       string
	Kind        string
	Payload     json.RawMessage
	State       string
	Priority    int16
	Attempt     int
	MaxAttempts int
	RunAt       time.Time
	// LeaseToken, LeasedBy, LeaseExpiresIn and HeartbeatAge describe the current or last lease;
	// nil or empty when the job was never claimed. LeaseExpiresIn is negative once it expired.
	LeaseToken     *int64
	LeasedBy       string
	LeaseExpiresIn *time.Duration
	HeartbeatAge   *time.Duration
	// RevokedAt is set once the job was revoked, with RevokeReason.
	RevokedAt    *time.Time
	RevokeReason string
	// Progress is what the handler last reported with Job.SetProgress; nil if nothing.
	Progress json.RawMessage
	// LastError is the last attempt's error; Errors the history of every failed attempt (a JSON
	// array).
	LastError   string
	Errors      json.RawMessage
	CreatedAt   time.Time
	AttemptedAt *time.Time
	FinishedAt  *time.Time
	// UniqueKey is the job's InsertOpts.UniqueKey; empty when none.
	UniqueKey string
	// Output is what the handler recorded with Job.SetOutput; nil if nothing.
	Output json.RawMessage
}

func jobRow(r store.JobRow) JobRow {
	return JobRow{ID: r.ID, Queue: r.Queue, Kind: r.Kind, Payload: json.RawMessage(r.Payload), State: r.State,
		Priority: r.Priority, Attempt: int(r.Attempt), MaxAttempts: int(r.MaxAttempts), RunAt: r.RunAt,
		LeaseToken: r.LeaseToken, LeasedBy: deref(r.LeasedBy), LeaseExpiresIn: r.LeaseExpiresIn, HeartbeatAge: r.HeartbeatAge,
		RevokedAt: r.RevokedAt, RevokeReason: deref(r.RevokeReason), Progress: rawJSON(r.Progress),
		LastError: deref(r.LastError), Errors: json.RawMessage(r.Errors), CreatedAt: r.CreatedAt,
		AttemptedAt: r.AttemptedAt, FinishedAt: r.FinishedAt, UniqueKey: deref(r.UniqueKey), Output: rawJSON(r.Output)}
}

func rawJSON(s *string) json.RawMessage {
	if s == nil {
		return nil
	}
	return json.RawMessage(*s)
}

// GetJob reads one job. It returns an error wrapping ErrJobNotFound when there is none.
func GetJob(ctx context.Context, db DB, id int64) (JobRow, error) {
	r, err := store.GetJob(ctx, db, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return JobRow{}, fmt.Errorf("job %d: %w", id, ErrJobNotFound)
	}
	if err != nil {
		return JobRow{}, err
	}
	return jobRow(r), nil
}

// Limits of ListJobs and RecentFailures.
const (
	// ListLimitDefault is the number of jobs returned when no limit is given.
	ListLimitDefault = 50
	// ListLimitMax is the largest limit accepted: a page, not an export.
	ListLimitMax = 1000
	// ListTimeoutDefault is ListJobsParams.Timeout's default.
	ListTimeoutDefault = 2 * time.Second
)

// ListJobsParams filter and page ListJobs. Empty filters match every job.
type ListJobsParams struct {
	Queue string
	Kind  string
	// State is one of the State constants; empty: every state.
	State string
	// BeforeID lists only jobs with a smaller id: pass the last ID of a page to get the next one
	// (keyset paging: a page costs the same however deep it is, and rows inserted meanwhile do
	// not shift it). 0 starts from the newest job.
	BeforeID int64
	// Limit is the most jobs returned, 1 to ListLimitMax. 0: ListLimitDefault.
	Limit int
	// Timeout bounds the query: a filter matching few of many rows may read much of the table.
	// Past it ListJobs returns ErrListTimeout. 0: ListTimeoutDefault.
	Timeout time.Duration
}

// ErrListTimeout: ListJobs gave up at ListJobsParams.Timeout, its filters matching too few of
// too many rows. Narrow the filters or start from a BeforeID nearer to the jobs sought.
var ErrListTimeout = errors.New("job list query took too long")

// JobSummary is one job of a list: enough to pick it, without its payload or output.
type JobSummary struct {
	ID          int64
	Queue       string
	Kind        string
	State       string
	Attempt     int
	MaxAttempts int
	CreatedAt   time.Time
	RunAt       time.Time
	FinishedAt  *time.Time
	// LastError holds the first 200 characters of the last error; empty when none.
	LastError string
}

// ListJobs lists the jobs matching p, newest (highest id) first. It runs in a transaction of its
// own (or a savepoint of db's, when db is a pgx.Tx) so that p.Timeout binds only its query.
func ListJobs(ctx context.Context, db Beginner, p ListJobsParams) ([]JobSummary, error) {
	limit, err := listLimit("ListJobsParams.Limit", p.Limit)
	if err != nil {
		return nil, err
	}
	if p.State != "" && !slices.Contains(States(), p.State) {
		return nil, fmt.Errorf("pool: ListJobsParams.State: unknown state %q", truncateForError(p.State))
	}
	if p.BeforeID < 0 || p.Timeout < 0 {
		return nil, errors.New("pool: ListJobsParams: BeforeID and Timeout must not be negative")
	}
	rows, err := store.ListJobs(ctx, db, store.ListParams{Queue: p.Queue, Kind: p.Kind, State: p.State, BeforeID: p.BeforeID,
		Limit: limit, Timeout: cmp.Or(p.Timeout, ListTimeoutDefault)})
	if err != nil {
		return nil, matchAlso(err, store.ErrListTimeout, ErrListTimeout)
	}
	out := make([]JobSummary, len(rows))
	for i, r := range rows {
		out[i] = JobSummary{ID: r.ID, Queue: r.Queue, Kind: r.Kind, State: r.State, Attempt: int(r.Attempt),
			MaxAttempts: int(r.MaxAttempts), CreatedAt: r.CreatedAt, RunAt: r.RunAt, FinishedAt: r.FinishedAt,
			LastError: deref(r.LastError)}
	}
	return out, nil
}

// RecentFailures reads up to limit jobs (1 to ListLimitMax; 0: ListLimitDefault) that failed for
// good or are waiting to retry, the most recent failure first.
func RecentFailures(ctx context.Context, db DB, limit int) ([]JobRow, error) {
	limit, err := listLimit("limit", limit)
	if err != nil {
		return nil, err
	}
	rows, err := store.RecentFailures(ctx, db, limit)
	if err != nil {
		return nil, err
	}
	out := make([]JobRow, len(rows))
	for i, r := range rows {
		out[i] = jobRow(r)
	}
	return out, nil
}

func listLimit(field string, n int) (int, error) {
	switch {
	case n == 0:
		return ListLimitDefault, nil
	case n < 0 || n > ListLimitMax:
		return 0, fmt.Errorf("pool: %s must be 1 to %d (0: %d), got %d", field, ListLimitMax, ListLimitDefault, n)
	}
	return n, nil
}

// RevokeJob revokes a job durably, as leash.revoke_job does: a queued job is cancelled at once; a
// running one is marked revoked and its worker is told on job_revoked, which cancels the
// handler's context with lease.ErrRevoked (at the latest at the worker's next renewal, should
// the notification be lost). reason is recorded on the job. It reports false for an unknown or
// already finished job.
func RevokeJob(ctx context.Context, db DB, id int64, reason string) (bool, error) {
	return store.Revoke(ctx, db, id, reason)
}
