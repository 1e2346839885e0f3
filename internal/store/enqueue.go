package store

import (
	"context"
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
	// TraceContext is the W3C trace context carrier as a JSON object; nil stores NULL.
	TraceContext []byte
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
		INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, trace_context)
		VALUES ($1, $2, coalesce($3::jsonb, '{}'), $4,
		        $5, coalesce($6, now() + $7 * interval '1 millisecond'),
		        nullif($8, 0) * interval '1 millisecond', $9::jsonb)
		RETURNING id`,
		p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, millis(p.Delay), millis(p.Timeout),
		nullJSON(p.TraceContext),
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
			r = append(r, pgtype.Interval{Microseconds: p.Timeout.Microseconds(), Valid: p.Timeout > 0})
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
