package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// InsertParams describes one job to enqueue, with every default already filled by the caller.
type InsertParams struct {
	Queue       string
	Kind        string
	Payload     []byte // JSON; nil means {}
	Priority    int16
	MaxAttempts int32
	RunAt       time.Time     // zero means now (database clock)
	Delay       time.Duration // added to now (database clock) when RunAt is zero
	Timeout     time.Duration // limit for one attempt; 0 means the kind's default
	// UniqueKey, when not empty: the job is not inserted while another job with this key is
	// unfinished (or, with UniqueWithin, finished less than that long ago).
	UniqueKey    string
	UniqueWithin time.Duration
	// TraceContext is the W3C trace context carrier as a JSON object; nil stores NULL.
	TraceContext []byte
}

func (p *InsertParams) scheduled() bool { return !p.RunAt.IsZero() || p.Delay > 0 }

// insertSQL adds one job unless its unique key is taken: by an unfinished job (the partial unique
// index, through ON CONFLICT DO NOTHING) or by a job finished less than $10 ms ago. It returns
// no row when the key is taken.
const insertSQL = `
	INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, unique_key, trace_context)
	SELECT $1, $2, coalesce($3::jsonb, '{}'), $4,
	       $5, coalesce($6, now() + $7 * interval '1 millisecond'),
	       nullif($8, 0) * interval '1 millisecond', nullif($9, ''), $11::jsonb
	WHERE $10::bigint <= 0 OR NOT EXISTS (
		SELECT FROM leash.jobs f
		WHERE f.unique_key = $9 AND f.state IN ('completed', 'failed', 'cancelled')
		  AND f.finished_at > now() - $10 * interval '1 millisecond')
	ON CONFLICT DO NOTHING
	RETURNING id`

// existingSQL finds the job that holds a unique key: the unfinished one, else the one finished
// last within $2 ms.
const existingSQL = `
	(SELECT id FROM leash.jobs WHERE unique_key = $1 AND state IN ('available', 'retryable', 'running'))
	UNION ALL
	(SELECT id FROM leash.jobs
	 WHERE $2::bigint > 0 AND unique_key = $1 AND state IN ('completed', 'failed', 'cancelled')
	   AND finished_at > now() - $2 * interval '1 millisecond'
	 ORDER BY finished_at DESC LIMIT 1)
	LIMIT 1`

// Insert adds one job and returns its id. With a unique key that another job holds, it inserts
// nothing and returns an error: use InsertUnique for such jobs.
func Insert(ctx context.Context, db DBTX, p InsertParams) (int64, error) {
	id, dup, err := InsertUnique(ctx, db, p)
	if err == nil && dup {
		return id, fmt.Errorf("insert job: unique key %q is held by job %d", p.UniqueKey, id)
	}
	return id, err
}

// InsertUnique adds one job and returns its id. With a unique key that another job holds, it
// inserts nothing and returns that job's id with duplicate set.
func InsertUnique(ctx context.Context, db DBTX, p InsertParams) (id int64, duplicate bool, err error) {
	var runAt *time.Time
	if !p.RunAt.IsZero() {
		runAt = &p.RunAt
	}
	if p.UniqueKey == "" {
		err = db.QueryRow(ctx, `
			INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, trace_context)
			VALUES ($1, $2, coalesce($3::jsonb, '{}'), $4,
			        $5, coalesce($6, now() + $7 * interval '1 millisecond'),
			        nullif($8, 0) * interval '1 millisecond', $9::jsonb)
			RETURNING id`,
			p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, millis(p.Delay), millis(p.Timeout),
			nullJSON(p.TraceContext),
		).Scan(&id)
		if err != nil {
			return 0, false, fmt.Errorf("insert job: %w", err)
		}
		return id, false, nil
	}
	// The holder of a key can finish between the insert and the lookup: then try again.
	for range 5 {
		err = db.QueryRow(ctx, insertSQL,
			p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, millis(p.Delay), millis(p.Timeout),
			p.UniqueKey, millis(p.UniqueWithin), nullJSON(p.TraceContext),
		).Scan(&id)
		if err == nil {
			return id, false, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, false, fmt.Errorf("insert job: %w", err)
		}
		err = db.QueryRow(ctx, existingSQL, p.UniqueKey, millis(p.UniqueWithin)).Scan(&id)
		if err == nil {
			return id, true, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, false, fmt.Errorf("insert job: find the job holding its unique key: %w", err)
		}
	}
	return 0, false, fmt.Errorf("insert job: unique key %q was taken and freed five times in a row", p.UniqueKey)
}

// insertManyUniqueSQL adds many jobs in one statement, skipping each whose unique key is taken
// (including by an earlier row of the same statement). COPY cannot skip conflicts.
const insertManyUniqueSQL = `
	INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, unique_key, trace_context)
	SELECT r.queue, r.kind, r.payload::jsonb, r.priority, r.max_attempts,
	       coalesce(r.run_at, now() + r.delay_ms * interval '1 millisecond'),
	       nullif(r.timeout_ms, 0) * interval '1 millisecond', nullif(r.unique_key, ''), r.trace_context::jsonb
	FROM unnest($1::text[], $2::text[], $3::text[], $4::smallint[], $5::int[], $6::timestamptz[], $7::bigint[],
	            $8::bigint[], $9::text[], $10::bigint[], $11::text[])
	     AS r(queue, kind, payload, priority, max_attempts, run_at, delay_ms, timeout_ms, unique_key, within_ms, trace_context)
	WHERE r.within_ms <= 0 OR r.unique_key = '' OR NOT EXISTS (
		SELECT FROM leash.jobs f
		WHERE f.unique_key = r.unique_key AND f.state IN ('completed', 'failed', 'cancelled')
		  AND f.finished_at > now() - r.within_ms * interval '1 millisecond')
	ON CONFLICT DO NOTHING`

// insertManyUnique adds jobs of which some have unique keys, in one statement; it returns how
// many it inserted (the others were duplicates).
func insertManyUnique(ctx context.Context, db DBTX, ps []InsertParams) (int64, error) {
	n := len(ps)
	queues, kinds, payloads, keys := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	prios, attempts := make([]int16, n), make([]int32, n)
	runAts := make([]*time.Time, n)
	delays, timeouts, withins := make([]int64, n), make([]int64, n), make([]int64, n)
	traces := make([]*string, n)
	for i := range ps {
		p := &ps[i]
		if p.TraceContext != nil {
			tc := string(p.TraceContext)
			traces[i] = &tc
		}
		queues[i], kinds[i], keys[i] = p.Queue, p.Kind, p.UniqueKey
		payloads[i] = "{}"
		if p.Payload != nil {
			payloads[i] = string(p.Payload)
		}
		prios[i], attempts[i] = p.Priority, p.MaxAttempts
		if !p.RunAt.IsZero() {
			runAts[i] = &p.RunAt
		}
		delays[i], timeouts[i], withins[i] = millis(p.Delay), millis(p.Timeout), millis(p.UniqueWithin)
	}
	tag, err := db.Exec(ctx, insertManyUniqueSQL, queues, kinds, payloads, prios, attempts, runAts, delays, timeouts, keys, withins, traces)
	if err != nil {
		return 0, fmt.Errorf("insert jobs with unique keys: %w", err)
	}
	return tag.RowsAffected(), nil
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

// InsertMany adds jobs with one COPY, which fires the job_available trigger once. Jobs with
// unique keys go in one INSERT ... ON CONFLICT DO NOTHING instead, which skips duplicates and
// counts only the jobs it inserted. When any job is
// scheduled, all run_at values are computed from the database clock read once in the same
// transaction.
func InsertMany(ctx context.Context, db CopyDB, ps []InsertParams) (int64, error) {
	if len(ps) == 0 {
		return 0, nil
	}
	for i := range ps {
		if ps[i].UniqueKey != "" {
			if dbtx, ok := db.(DBTX); ok {
				return insertManyUnique(ctx, dbtx, ps)
			}
			return 0, fmt.Errorf("insert jobs with unique keys: %T cannot run queries", db)
		}
	}
	scheduled, timeouts, traces := false, false, false
	for i := range ps {
		scheduled = scheduled || ps[i].scheduled()
		timeouts = timeouts || ps[i].Timeout > 0
		traces = traces || ps[i].TraceContext != nil
	}
	cols := []string{"queue", "kind", "payload", "priority", "max_attempts"}
	if timeouts {
		cols = append(cols, "timeout")
	}
	if traces {
		cols = append(cols, "trace_context")
	}
	row := func(p *InsertParams) []any {
		payload := p.Payload
		if payload == nil {
			payload = []byte("{}")
		}
		r := []any{p.Queue, p.Kind, string(payload), p.Priority, p.MaxAttempts}
		if timeouts {
			r = append(r, pgtype.Interval{Microseconds: millis(p.Timeout) * 1000, Valid: p.Timeout > 0})
		}
		if traces {
			r = append(r, nullJSON(p.TraceContext))
		}
		return r
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
