package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Status is a snapshot of the queue for operators.
type Status struct {
	Counts        []StateCount
	OldestWaiting *Waiting
	Running       []RunningJob
}

// StateCount is the number of jobs of one queue in one state.
type StateCount struct {
	Queue string
	State string
	Count int64
}

// Waiting is the job that has been runnable the longest.
type Waiting struct {
	ID    int64
	Kind  string
	Queue string
	Age   time.Duration
}

// RunningJob is a job under lease.
type RunningJob struct {
	ID           int64
	Kind         string
	Queue        string
	Holder       string
	Attempt      int32
	MaxAttempts  int32
	Token        int64
	HeartbeatAge time.Duration
	LeaseLeft    time.Duration
	Revoked      bool
	Progress     string
}

// finiteTS is col as a timestamp time.Time can hold and NULL as NULL: any SQL client may write
// infinity or -infinity, which read as the largest and smallest time the admin reads show.
func finiteTS(col string) string {
	return `CASE WHEN ` + col + ` IS NULL THEN NULL WHEN pg_catalog.isfinite(` + col + `) THEN ` + col +
		` WHEN ` + col + ` > 'epoch'::timestamptz THEN '9999-12-31 00:00:00+00'::timestamptz ELSE '0001-01-01 00:00:00+00'::timestamptz END`
}

// span is a - b as an interval a time.Duration can hold (within ±100 years), NULL when either is
// NULL: an infinite timestamp reads as the farthest span, never as an error that fails the read
// of every row.
func span(a, b string) string {
	return `CASE WHEN ` + a + ` IS NULL OR ` + b + ` IS NULL THEN NULL` +
		` WHEN pg_catalog.isfinite(` + a + `) AND pg_catalog.isfinite(` + b + `) THEN least(greatest(` + a + ` - ` + b + `, interval '-100 years'), interval '100 years')` +
		` WHEN ` + a + ` > ` + b + ` THEN interval '100 years' ELSE interval '-100 years' END`
}

// The statements of ReadStatus and RecentFailures.
var (
	statusCountsSQL  = `SELECT queue, state, count(*) FROM leash.jobs GROUP BY 1, 2 ORDER BY 1, 2`
	oldestWaitingSQL = `
		SELECT id, kind, queue, ` + span("now()", "run_at") + ` FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND run_at <= now()
		ORDER BY run_at, id LIMIT 1`
	runningSQL = `
		SELECT id, kind, queue, coalesce(leased_by, ''), attempt, max_attempts, lease_token,
		       coalesce(` + span("now()", "heartbeat_at") + `, interval '0'), coalesce(` + span("lease_expires_at", "now()") + `, interval '0'),
		       revoked_at IS NOT NULL, coalesce(progress::text, '')
		FROM leash.jobs WHERE state = 'running'
		ORDER BY heartbeat_at LIMIT $1`
	// Queued and running jobs only: the partial indexes hold them, so the cost follows the
	// backlog, not the finished jobs retention keeps.
	// One branch per index: with the three states in one condition the planner reads the table.
	liveCountsSQL = `
		SELECT * FROM (
			SELECT queue, state, count(*) FROM leash.jobs WHERE state IN ('available', 'retryable') GROUP BY 1, 2
			UNION ALL
			SELECT queue, state, count(*) FROM leash.jobs WHERE state = 'running' GROUP BY 1, 2
		) c ORDER BY 1, 2`
	// The newest failed jobs walk jobs_finished_idx backwards; retryable ones are among the
	// queued rows (jobs_claimable_idx). A failed job always has finished_at (the outcome, the
	// rescuer and revocation set it together with the state).
	recentFailuresSQL = `
		SELECT * FROM (
			(SELECT ` + jobColumns + ` FROM leash.jobs j
			 WHERE j.state = 'failed' AND j.finished_at IS NOT NULL ORDER BY j.finished_at DESC LIMIT $1)
			UNION ALL
			(SELECT ` + jobColumns + ` FROM leash.jobs j
			 WHERE j.state = 'retryable' ORDER BY j.attempted_at DESC NULLS LAST LIMIT $1)
		) f
		ORDER BY coalesce(finished_at, attempted_at) DESC NULLS LAST LIMIT $1`
)

// ReadStatus reads counts per queue and state, the oldest runnable job, and up to limit running
// jobs (oldest heartbeat first). Ages come from the database clock. Counting every row, it reads
// the whole table: see ReadLiveStatus.
func ReadStatus(ctx context.Context, db DBTX, limit int) (Status, error) {
	return readStatus(ctx, db, statusCountsSQL, limit)
}

// ReadLiveStatus is ReadStatus with counts of the queued and running jobs only, which it reads
// through the partial indexes that hold them: its cost follows the backlog, however many finished
// jobs the table keeps. For a page that refreshes itself.
func ReadLiveStatus(ctx context.Context, db DBTX, limit int) (Status, error) {
	return readStatus(ctx, db, liveCountsSQL, limit)
}

func readStatus(ctx context.Context, db DBTX, countsSQL string, limit int) (Status, error) {
	var st Status
	rows, err := db.Query(ctx, countsSQL)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	st.Counts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[StateCount])
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	var w Waiting
	err = db.QueryRow(ctx, oldestWaitingSQL).Scan(&w.ID, &w.Kind, &w.Queue, &w.Age)
	switch {
	case err == nil:
		st.OldestWaiting = &w
	case !errors.Is(err, pgx.ErrNoRows):
		return st, fmt.Errorf("read status: %w", err)
	}
	rows, err = db.Query(ctx, runningSQL, limit)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	st.Running, err = pgx.CollectRows(rows, pgx.RowToStructByPos[RunningJob])
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	return st, nil
}

// JobRow is every column of one job, for operators.
type JobRow struct {
	ID             int64
	Queue          string
	Kind           string
	Payload        string
	State          string
	Priority       int16
	Attempt        int32
	MaxAttempts    int32
	RunAt          time.Time
	LeaseToken     *int64
	LeasedBy       *string
	LeaseExpiresIn *time.Duration
	HeartbeatAge   *time.Duration
	RevokedAt      *time.Time
	RevokeReason   *string
	Progress       *string
	LastError      *string
	Errors         string
	CreatedAt      time.Time
	AttemptedAt    *time.Time
	FinishedAt     *time.Time
	UniqueKey      *string
	Output         *string // pretty-printed JSON
	WorkflowID     *int64
	Step           *string
}

var jobColumns = `id, queue, kind, jsonb_pretty(payload), state, priority, attempt, max_attempts, ` + finiteTS("run_at") + ` AS run_at,
	lease_token, leased_by, ` + span("lease_expires_at", "now()") + ` AS lease_expires_in, ` + span("now()", "heartbeat_at") + ` AS heartbeat_age,
	` + finiteTS("revoked_at") + ` AS revoked_at, revoke_reason, progress::text, last_error, jsonb_pretty(errors),
	` + finiteTS("created_at") + ` AS created_at, ` + finiteTS("attempted_at") + ` AS attempted_at, ` + finiteTS("finished_at") + ` AS finished_at,
	unique_key, jsonb_pretty(output), workflow_id, step`

// GetJob reads one job; pgx.ErrNoRows when there is none.
func GetJob(ctx context.Context, db DBTX, id int64) (JobRow, error) {
	rows, err := db.Query(ctx, `SELECT `+jobColumns+` FROM leash.jobs WHERE id = $1`, id)
	if err != nil {
		return JobRow{}, fmt.Errorf("read job %d: %w", id, err)
	}
	j, err := pgx.CollectExactlyOneRow(rows, pgx.RowToStructByPos[JobRow])
	if err != nil {
		return JobRow{}, fmt.Errorf("read job %d: %w", id, err)
	}
	return j, nil
}

// RecentFailures reads the last limit jobs that failed or are waiting to retry, newest first.
func RecentFailures(ctx context.Context, db DBTX, limit int) ([]JobRow, error) {
	rows, err := db.Query(ctx, recentFailuresSQL, limit)
	if err != nil {
		return nil, fmt.Errorf("read failures: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[JobRow])
	if err != nil {
		return nil, fmt.Errorf("read failures: %w", err)
	}
	return out, nil
}

// NotificationQueueUsage reads pg_notification_queue_usage(), the fraction of the server's
// notification queue in use.
func NotificationQueueUsage(ctx context.Context, db DBTX) (float64, error) {
	var u float64
	if err := db.QueryRow(ctx, `SELECT pg_notification_queue_usage()`).Scan(&u); err != nil {
		return 0, fmt.Errorf("read notification queue usage: %w", err)
	}
	return u, nil
}

// ListParams filter ListJobs. Empty fields match every job.
type ListParams struct {
	Queue, Kind, State string
	// BeforeID lists jobs with a smaller id only (the next page); 0 starts from the newest.
	BeforeID int64
	// Limit is the most jobs returned. Default 50.
	Limit int
	// Timeout bounds the query (a filter that matches few of many rows may read the whole
	// table); past it ListJobs returns ErrListTimeout. Default 2s.
	Timeout time.Duration
}

// ErrListTimeout: ListJobs gave up, the filters matching too few of too many rows.
var ErrListTimeout = errors.New("job list query took too long")

// JobSummary is one line of the job list.
type JobSummary struct {
	ID          int64
	Queue       string
	Kind        string
	State       string
	Attempt     int32
	MaxAttempts int32
	CreatedAt   time.Time
	RunAt       time.Time
	FinishedAt  *time.Time
	// LastError holds the first 200 characters of the last error.
	LastError *string
}

// ListJobs lists the jobs matching p, newest (highest id) first. The values in p are sent as
// parameters, never written into the SQL.
func ListJobs(ctx context.Context, db Beginner, p ListParams) ([]JobSummary, error) {
	if p.Limit <= 0 {
		p.Limit = 50
	}
	if p.Timeout <= 0 {
		p.Timeout = 2 * time.Second
	}
	where := []string{"true"}
	args := []any{p.Limit}
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, fmt.Sprintf(cond, len(args)))
	}
	if p.Queue != "" {
		add("queue = $%d", p.Queue)
	}
	if p.Kind != "" {
		add("kind = $%d", p.Kind)
	}
	if p.State != "" {
		add("state = $%d", p.State)
	}
	if p.BeforeID > 0 {
		add("id < $%d", p.BeforeID)
	}
	var out []JobSummary
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT set_config('statement_timeout', $1, true)", strconv.FormatInt(max(p.Timeout.Milliseconds(), 1), 10)+"ms"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `
			SELECT id, queue, kind, state, attempt, max_attempts, `+finiteTS("created_at")+`, `+finiteTS("run_at")+`,
			       `+finiteTS("finished_at")+`, left(last_error, 200)
			FROM leash.jobs WHERE `+strings.Join(where, " AND ")+`
			ORDER BY id DESC LIMIT $1`, args...)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, pgx.RowToStructByPos[JobSummary])
		return err
	})
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "57014" && ctx.Err() == nil { // query_canceled by the statement_timeout
		return nil, ErrListTimeout
	}
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	return out, nil
}
