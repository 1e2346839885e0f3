// Package store holds every SQL statement leash runs against leash.jobs, one params struct per
// query, so that the SQL is in one place to read and review. It is internal: applications use
// package pool.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DBTX is what a query needs: a pool, a connection or a transaction.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner starts transactions.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Job states.
const (
	StateAvailable = "available"
	StateRunning   = "running"
	StateRetryable = "retryable"
	StateCompleted = "completed"
	StateFailed    = "failed"
	StateCancelled = "cancelled"
)

// Channels leash notifies on.
const (
	ChannelJobAvailable = "job_available"
	ChannelJobRevoked   = "job_revoked"
)

func millis(d time.Duration) int64 { return d.Milliseconds() }

// InsertParams describes one job to enqueue. Zero values take the table defaults.
type InsertParams struct {
	Queue       string
	Kind        string
	Payload     []byte // JSON; nil means {}
	Priority    int16
	MaxAttempts int32         // 0 means the table default
	RunAt       time.Time     // zero means now (database clock)
	Delay       time.Duration // added to now (database clock) when RunAt is zero
}

func (p *InsertParams) scheduled() bool { return !p.RunAt.IsZero() || p.Delay > 0 }

// Insert adds one job and returns its id.
func Insert(ctx context.Context, db DBTX, p InsertParams) (int64, error) {
	var runAt *time.Time
	if !p.RunAt.IsZero() {
		runAt = &p.RunAt
	}
	var id int64
	err := db.QueryRow(ctx, `
		INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at)
		VALUES (coalesce(nullif($1, ''), 'default'), $2, coalesce($3::jsonb, '{}'), $4,
		        coalesce(nullif($5, 0), 20), coalesce($6, now() + $7 * interval '1 millisecond'))
		RETURNING id`,
		p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, millis(p.Delay),
	).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("insert job: %w", err)
	}
	return id, nil
}

func nullJSON(b []byte) any {
	if b == nil {
		return nil
	}
	return string(b)
}

// CopyDB is what InsertMany needs: COPY and transactions.
type CopyDB interface {
	Beginner
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

// InsertMany adds jobs with one COPY, which fires the job_available trigger once. When any job is
// scheduled, all run_at values are computed from the database clock read once in the same
// transaction.
func InsertMany(ctx context.Context, db CopyDB, ps []InsertParams) (int64, error) {
	if len(ps) == 0 {
		return 0, nil
	}
	scheduled := false
	for i := range ps {
		if ps[i].scheduled() {
			scheduled = true
			break
		}
	}
	cols := []string{"queue", "kind", "payload", "priority", "max_attempts"}
	row := func(p *InsertParams) []any {
		q := p.Queue
		if q == "" {
			q = "default"
		}
		payload := p.Payload
		if payload == nil {
			payload = []byte("{}")
		}
		ma := p.MaxAttempts
		if ma == 0 {
			ma = 20
		}
		return []any{q, p.Kind, string(payload), p.Priority, ma}
	}
	table := pgx.Identifier{"leash", "jobs"}
	if !scheduled {
		n, err := db.CopyFrom(ctx, table, cols, pgx.CopyFromSlice(len(ps), func(i int) ([]any, error) {
			return row(&ps[i]), nil
		}))
		if err != nil {
			return 0, fmt.Errorf("copy jobs: %w", err)
		}
		return n, nil
	}
	var n int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var now time.Time
		if err := tx.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
			return fmt.Errorf("read database clock: %w", err)
		}
		var err error
		n, err = tx.CopyFrom(ctx, table, append(cols, "run_at"), pgx.CopyFromSlice(len(ps), func(i int) ([]any, error) {
			p := &ps[i]
			runAt := p.RunAt
			if runAt.IsZero() {
				runAt = now.Add(p.Delay)
			}
			return append(row(p), runAt), nil
		}))
		if err != nil {
			return fmt.Errorf("copy jobs: %w", err)
		}
		return nil
	})
	return n, err
}

// ClaimParams selects and leases runnable jobs.
type ClaimParams struct {
	Queues   []string
	Limit    int
	WorkerID string
	Lease    time.Duration
}

// ClaimedJob is a row just leased to this worker.
type ClaimedJob struct {
	ID          int64
	Queue       string
	Kind        string
	Payload     []byte
	Priority    int16
	Attempt     int32
	MaxAttempts int32
	Token       int64
	CreatedAt   time.Time
	RunAt       time.Time
	AttemptedAt time.Time
}

const claimSQL = `
	WITH picked AS (
		SELECT id FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND %s AND run_at <= now()
		ORDER BY priority, run_at, id
		LIMIT $2
		FOR UPDATE SKIP LOCKED
	)
	UPDATE leash.jobs j
	SET state = 'running', attempt = j.attempt + 1, lease_token = nextval('leash.lease_tokens'),
	    leased_by = $3, lease_expires_at = now() + $4 * interval '1 millisecond',
	    heartbeat_at = now(), attempted_at = now()
	FROM picked
	WHERE j.id = picked.id
	RETURNING j.id, j.queue, j.kind, j.payload, j.priority, j.attempt, j.max_attempts, j.lease_token,
	          j.created_at, j.run_at, j.attempted_at`

var (
	claimOneQueueSQL   = fmt.Sprintf(claimSQL, "queue = $1")
	claimManyQueuesSQL = fmt.Sprintf(claimSQL, "queue = ANY($1)")
)

// Claim leases up to p.Limit runnable jobs in one statement, in priority, run_at, id order,
// skipping rows other workers hold locked.
func Claim(ctx context.Context, db DBTX, p ClaimParams) ([]ClaimedJob, error) {
	var queues any = p.Queues
	q := claimManyQueuesSQL
	if len(p.Queues) == 1 {
		q, queues = claimOneQueueSQL, p.Queues[0]
	}
	rows, err := db.Query(ctx, q, queues, p.Limit, p.WorkerID, millis(p.Lease))
	if err != nil {
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	jobs := make([]ClaimedJob, 0, p.Limit)
	for rows.Next() {
		var j ClaimedJob
		if err := rows.Scan(&j.ID, &j.Queue, &j.Kind, &j.Payload, &j.Priority, &j.Attempt, &j.MaxAttempts,
			&j.Token, &j.CreatedAt, &j.RunAt, &j.AttemptedAt); err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim jobs: %w", err)
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	return jobs, nil
}

// RenewParams extends many leases at once; IDs[i] is held under Tokens[i].
type RenewParams struct {
	IDs    []int64
	Tokens []int64
	Lease  time.Duration
}

// Renew extends every lease that is still held under its token and not revoked, in one
// statement, and returns the ids it extended. An id missing from the result is lost.
func Renew(ctx context.Context, db DBTX, p RenewParams) ([]int64, error) {
	// Rows are locked in id order first: concurrent multi-row writes on the same rows (a renewal
	// and an outcome batch) then never wait on each other in a cycle.
	rows, err := db.Query(ctx, `
		WITH locked AS (
			SELECT j.id FROM leash.jobs j
			JOIN unnest($1::bigint[], $2::bigint[]) AS u(id, token) ON j.id = u.id AND j.lease_token = u.token
			WHERE j.state = 'running' AND j.revoked_at IS NULL
			ORDER BY j.id
			FOR NO KEY UPDATE OF j
		)
		UPDATE leash.jobs j
		SET lease_expires_at = now() + $3 * interval '1 millisecond', heartbeat_at = now()
		FROM locked
		WHERE j.id = locked.id
		RETURNING j.id`, p.IDs, p.Tokens, millis(p.Lease))
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	return ids, nil
}

// LeaseState is what the row says about a lease that was not renewed.
type LeaseState struct {
	ID           int64
	Token        *int64
	State        string
	Revoked      bool
	RevokeReason *string
}

// LeaseStates reads the rows of leases that were not renewed, to tell a revocation from a
// takeover. Ids with no row are absent from the result.
func LeaseStates(ctx context.Context, db DBTX, ids []int64) ([]LeaseState, error) {
	rows, err := db.Query(ctx, `
		SELECT id, lease_token, state, revoked_at IS NOT NULL, revoke_reason
		FROM leash.jobs WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read lease states: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LeaseState, error) {
		var s LeaseState
		err := r.Scan(&s.ID, &s.Token, &s.State, &s.Revoked, &s.RevokeReason)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("read lease states: %w", err)
	}
	return out, nil
}

// Outcome is the fenced final write for one claim.
type Outcome struct {
	ID    int64
	Token int64
	// State is completed, failed, cancelled, retryable, or available for a hand-back that
	// returns the attempt (a revoked job handed back becomes cancelled instead).
	State string
	// Delay before a retryable job may run again, from the database clock.
	Delay time.Duration
	// Error is appended to the errors history (with the database time) and kept as
	// last_error; nil leaves both alone.
	Error *AttemptError
	// RevokeReason is recorded with a cancelled outcome when the row has no revocation yet.
	RevokeReason string
}

// AttemptError is one entry of a job's errors history.
type AttemptError struct {
	Attempt int32  `json:"attempt"`
	Error   string `json:"error"`
	Worker  string `json:"worker,omitempty"`
	Stack   string `json:"stack,omitempty"`
}

// Finish writes many outcomes in one statement, each guarded by its id and lease token, and
// returns the ids it wrote. An id missing from the result had lost its lease: nothing was
// written for it.
func Finish(ctx context.Context, db DBTX, outs []Outcome) ([]int64, error) {
	n := len(outs)
	ids, tokens, states := make([]int64, n), make([]int64, n), make([]string, n)
	delays, errs, reasons := make([]int64, n), make([]*string, n), make([]*string, n)
	for i := range outs {
		o := &outs[i]
		ids[i], tokens[i], states[i], delays[i] = o.ID, o.Token, o.State, millis(o.Delay)
		if o.RevokeReason != "" {
			reasons[i] = &o.RevokeReason
		}
		if o.Error != nil {
			b, err := json.Marshal(o.Error)
			if err != nil {
				return nil, fmt.Errorf("encode attempt error: %w", err)
			}
			s := string(b)
			errs[i] = &s
		}
	}
	rows, err := db.Query(ctx, `
		WITH u AS (
			-- Locked in id order, like every multi-row write (see Renew); the row's token is
			-- checked here, on the latest row version.
			SELECT j.id, i.state, i.delay_ms, i.err, i.reason
			FROM leash.jobs j
			JOIN unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[], $5::jsonb[], $6::text[])
				AS i(id, token, state, delay_ms, err, reason) ON j.id = i.id AND j.lease_token = i.token
			ORDER BY j.id
			FOR NO KEY UPDATE OF j
		)
		UPDATE leash.jobs j
		SET state = CASE WHEN u.state = 'available' AND j.revoked_at IS NOT NULL THEN 'cancelled' ELSE u.state END,
		    attempt = CASE WHEN u.state = 'available' THEN greatest(j.attempt - 1, 0) ELSE j.attempt END,
		    run_at = CASE WHEN u.state IN ('available', 'retryable') THEN now() + u.delay_ms * interval '1 millisecond' ELSE j.run_at END,
		    finished_at = CASE WHEN u.state IN ('completed', 'failed', 'cancelled')
		                         OR (u.state = 'available' AND j.revoked_at IS NOT NULL) THEN now() END,
		    errors = CASE WHEN u.err IS NULL THEN j.errors ELSE j.errors || jsonb_build_array(jsonb_build_object('at', now()) || u.err) END,
		    last_error = coalesce(u.err->>'error', j.last_error),
		    revoke_reason = CASE WHEN u.state = 'cancelled' AND j.revoked_at IS NULL THEN u.reason ELSE j.revoke_reason END,
		    revoked_at = CASE WHEN u.state = 'cancelled' THEN coalesce(j.revoked_at, now()) ELSE j.revoked_at END,
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		FROM u
		WHERE j.id = u.id
		RETURNING j.id, CASE WHEN j.state = 'available' THEN leash.notify_available(j.queue) END`,
		ids, tokens, states, delays, errs, reasons)
	if err != nil {
		return nil, fmt.Errorf("finish jobs: %w", err)
	}
	written := make([]int64, 0, n)
	for rows.Next() {
		var id int64
		var notified *bool
		if err := rows.Scan(&id, &notified); err != nil {
			rows.Close()
			return nil, fmt.Errorf("finish jobs: %w", err)
		}
		written = append(written, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("finish jobs: %w", err)
	}
	return written, nil
}

// Rescued is a running job whose lease expired and that a rescuer took back.
type Rescued struct {
	ID       int64
	OldToken int64
	OldOwner string
	State    string // retryable, failed or cancelled
}

// Rescue takes back up to limit running jobs whose lease expired on the database clock, each
// guarded by the token it read: retryable and runnable at once, failed when its attempts are
// used up, cancelled when it was revoked. Each old holder is told on job_revoked with its token.
// Rows another rescuer is working on are skipped.
func Rescue(ctx context.Context, db DBTX, limit int) ([]Rescued, error) {
	rows, err := db.Query(ctx, `
		WITH expired AS (
			SELECT id, lease_token, leased_by FROM leash.jobs
			WHERE state = 'running' AND lease_expires_at < now()
			ORDER BY lease_expires_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED
		)
		UPDATE leash.jobs j
		SET state = CASE WHEN j.revoked_at IS NOT NULL THEN 'cancelled'
		                 WHEN j.attempt >= j.max_attempts THEN 'failed'
		                 ELSE 'retryable' END,
		    finished_at = CASE WHEN j.revoked_at IS NOT NULL OR j.attempt >= j.max_attempts THEN now() END,
		    run_at = now(),
		    last_error = 'lease expired: worker ' || coalesce(e.leased_by, '?') || ' stopped renewing',
		    errors = j.errors || jsonb_build_array(jsonb_build_object(
		        'at', now(), 'attempt', j.attempt, 'worker', e.leased_by, 'token', e.lease_token,
		        'error', 'lease expired: worker ' || coalesce(e.leased_by, '?') || ' stopped renewing')),
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		FROM expired e
		WHERE j.id = e.id AND j.lease_token = e.lease_token
		RETURNING j.id, e.lease_token, coalesce(e.leased_by, ''), j.state,
		    leash.notify_revoked(j.id, e.lease_token, 'lease expired', true),
		    CASE WHEN j.state = 'retryable' THEN leash.notify_available(j.queue) END`, limit)
	if err != nil {
		return nil, fmt.Errorf("rescue expired leases: %w", err)
	}
	var out []Rescued
	for rows.Next() {
		var r Rescued
		var notified, notifiedAvailable *bool
		if err := rows.Scan(&r.ID, &r.OldToken, &r.OldOwner, &r.State, &notified, &notifiedAvailable); err != nil {
			rows.Close()
			return nil, fmt.Errorf("rescue expired leases: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("rescue expired leases: %w", err)
	}
	return out, nil
}

// ErrFenced means a fenced write found the lease gone: the job is no longer held under the
// token the caller has.
var ErrFenced = errors.New("lease token no longer holds")

// Fence locks the job row in tx and fails with ErrFenced unless it is still running under token,
// so that the caller's other writes in tx commit only under a live lease.
func Fence(ctx context.Context, tx DBTX, id, token int64) error {
	var one int
	err := tx.QueryRow(ctx, `
		SELECT 1 FROM leash.jobs WHERE id = $1 AND lease_token = $2 AND state = 'running'
		FOR NO KEY UPDATE`, id, token).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrFenced
	}
	if err != nil {
		return fmt.Errorf("fence job %d: %w", id, err)
	}
	return nil
}

// CompleteTx marks the job completed in tx, guarded by its token; ErrFenced when the lease is
// gone.
func CompleteTx(ctx context.Context, tx DBTX, id, token int64) error {
	tag, err := tx.Exec(ctx, `
		UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		WHERE id = $1 AND lease_token = $2`, id, token)
	if err != nil {
		return fmt.Errorf("complete job %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return ErrFenced
	}
	return nil
}

// SetProgress stores a checkpoint on the job, guarded by its token; ErrFenced when the lease
// is gone.
func SetProgress(ctx context.Context, db DBTX, id, token int64, progress []byte) error {
	tag, err := db.Exec(ctx, `UPDATE leash.jobs SET progress = $3 WHERE id = $1 AND lease_token = $2`,
		id, token, string(progress))
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return ErrFenced
	}
	return nil
}

// MarkRevoked records a revocation that arrived as a notification on a job this worker holds,
// guarded by its token. It reports whether the row changed (false when already revoked or the
// lease is gone).
func MarkRevoked(ctx context.Context, db DBTX, id, token int64, reason string) (bool, error) {
	tag, err := db.Exec(ctx, `
		UPDATE leash.jobs SET revoked_at = now(), revoke_reason = $3
		WHERE id = $1 AND lease_token = $2 AND revoked_at IS NULL`, id, token, reason)
	if err != nil {
		return false, fmt.Errorf("record revocation of job %d: %w", id, err)
	}
	return tag.RowsAffected() > 0, nil
}

// Revoke calls leash.revoke_job.
func Revoke(ctx context.Context, db DBTX, id int64, reason string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT leash.revoke_job($1, nullif($2, ''))`, id, reason).Scan(&ok); err != nil {
		return false, fmt.Errorf("revoke job %d: %w", id, err)
	}
	return ok, nil
}

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

// ReadStatus reads counts per queue and state, the oldest runnable job, and up to limit running
// jobs (oldest heartbeat first). Ages come from the database clock.
func ReadStatus(ctx context.Context, db DBTX, limit int) (Status, error) {
	var st Status
	rows, err := db.Query(ctx, `SELECT queue, state, count(*) FROM leash.jobs GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	st.Counts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[StateCount])
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	var w Waiting
	err = db.QueryRow(ctx, `
		SELECT id, kind, queue, now() - run_at FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND run_at <= now()
		ORDER BY run_at, id LIMIT 1`).Scan(&w.ID, &w.Kind, &w.Queue, &w.Age)
	switch {
	case err == nil:
		st.OldestWaiting = &w
	case !errors.Is(err, pgx.ErrNoRows):
		return st, fmt.Errorf("read status: %w", err)
	}
	rows, err = db.Query(ctx, `
		SELECT id, kind, queue, coalesce(leased_by, ''), attempt, max_attempts, lease_token,
		       now() - heartbeat_at, lease_expires_at - now(), revoked_at IS NOT NULL, coalesce(progress::text, '')
		FROM leash.jobs WHERE state = 'running'
		ORDER BY heartbeat_at LIMIT $1`, limit)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	st.Running, err = pgx.CollectRows(rows, pgx.RowToStructByPos[RunningJob])
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	return st, nil
}

// DeleteFinished deletes up to batch jobs that finished (completed when completed is true; failed
// or cancelled otherwise) more than olderThan ago, oldest first, skipping rows locked by another
// deleter, and returns how many it deleted. Each call is one short statement.
func DeleteFinished(ctx context.Context, db DBTX, completed bool, olderThan time.Duration, batch int) (int64, error) {
	states := `state IN ('failed', 'cancelled')`
	if completed {
		states = `state = 'completed'`
	}
	tag, err := db.Exec(ctx, `
		DELETE FROM leash.jobs WHERE id IN (
			SELECT id FROM leash.jobs
			WHERE `+states+` AND finished_at < now() - $1 * interval '1 millisecond'
			ORDER BY finished_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED)`, millis(olderThan), batch)
	if err != nil {
		return 0, fmt.Errorf("delete finished jobs: %w", err)
	}
	return tag.RowsAffected(), nil
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
}

const jobColumns = `id, queue, kind, jsonb_pretty(payload), state, priority, attempt, max_attempts, run_at,
	lease_token, leased_by, lease_expires_at - now(), now() - heartbeat_at, revoked_at, revoke_reason,
	progress::text, last_error, jsonb_pretty(errors), created_at, attempted_at, finished_at`

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
	rows, err := db.Query(ctx, `
		SELECT `+jobColumns+` FROM leash.jobs
		WHERE state IN ('failed', 'retryable')
		ORDER BY coalesce(finished_at, attempted_at) DESC NULLS LAST LIMIT $1`, limit)
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
