package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/leashq/leash/internal/clean"
)

// ScheduleRow is one row of leash.schedules.
type ScheduleRow struct {
	Name        string
	Spec        string
	Kind        string
	Payload     []byte
	Queue       string
	Priority    int16
	MaxAttempts int32
	Timeout     time.Duration // 0: none
	NextRunAt   *time.Time    // nil: not armed yet; year 9999+ ('infinity') while the spec is refused
	LastRunAt   *time.Time
	LastJobID   *int64
	LastError   *string
	CreatedAt   time.Time
	UpdatedAt   time.Time
}

const scheduleColumns = `name, spec, kind, payload, queue, priority, max_attempts,
	` + timeoutMillisSQL + `, next_run_at, last_run_at, last_job_id, last_error,
	created_at, updated_at`

// scanSchedule reads a row written by anyone: every timestamp goes through pgtype, which holds
// 'infinity' too.
func scanSchedule(row pgx.Row) (ScheduleRow, error) {
	var s ScheduleRow
	var timeoutMS int64
	var next, last, created, updated pgtype.Timestamptz
	err := row.Scan(&s.Name, &s.Spec, &s.Kind, &s.Payload, &s.Queue, &s.Priority, &s.MaxAttempts, &timeoutMS,
		&next, &last, &s.LastJobID, &s.LastError, &created, &updated)
	s.Timeout = time.Duration(timeoutMS) * time.Millisecond
	s.NextRunAt, s.LastRunAt = timestamptz(next), timestamptz(last)
	if t := timestamptz(created); t != nil {
		s.CreatedAt = *t
	}
	if t := timestamptz(updated); t != nil {
		s.UpdatedAt = *t
	}
	return s, err
}

// timestamptz maps NULL to nil and ±infinity to far dates, which time.Time can hold.
func timestamptz(t pgtype.Timestamptz) *time.Time {
	if !t.Valid {
		return nil
	}
	switch t.InfinityModifier {
	case pgtype.Infinity:
		v := Never
		return &v
	case pgtype.NegativeInfinity:
		v := time.Time{}
		return &v
	}
	return &t.Time
}

// Never is how an 'infinity' next_run_at reads: the schedule does not fire.
var Never = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)

// UpsertSchedule inserts or updates a schedule by name. A changed spec re-arms it (the
// database's trigger clears next_run_at and last_error); an unchanged row is left alone.
func UpsertSchedule(ctx context.Context, db DBTX, s ScheduleRow) error {
	payload := s.Payload
	if payload == nil {
		payload = []byte("{}")
	}
	_, err := db.Exec(ctx, `
		INSERT INTO leash.schedules AS s (name, spec, kind, payload, queue, priority, max_attempts, timeout)
		VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, nullif($8, 0) * interval '1 millisecond')
		ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, kind = excluded.kind, payload = excluded.payload,
		    queue = excluded.queue, priority = excluded.priority, max_attempts = excluded.max_attempts,
		    timeout = excluded.timeout, updated_at = now()
		WHERE (s.spec, s.kind, s.payload, s.queue, s.priority, s.max_attempts, s.timeout)
		      IS DISTINCT FROM (excluded.spec, excluded.kind, excluded.payload, excluded.queue, excluded.priority,
		                        excluded.max_attempts, excluded.timeout)`,
		s.Name, s.Spec, s.Kind, string(payload), s.Queue, s.Priority, s.MaxAttempts, millis(s.Timeout))
	if err != nil {
		return fmt.Errorf("upsert schedule %q: %w", s.Name, err)
	}
	return nil
}

// RemoveSchedule deletes a schedule; false when there was none. Jobs it enqueued stay.
func RemoveSchedule(ctx context.Context, db DBTX, name string) (bool, error) {
	tag, err := db.Exec(ctx, `DELETE FROM leash.schedules WHERE name = $1`, name)
	if err != nil {
		return false, fmt.Errorf("remove schedule %q: %w", name, err)
	}
	return tag.RowsAffected() > 0, nil
}

// ListSchedules returns every schedule by name.
func ListSchedules(ctx context.Context, db DBTX) ([]ScheduleRow, error) {
	rows, err := db.Query(ctx, `SELECT `+scheduleColumns+` FROM leash.schedules j ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("list schedules: %w", err)
	}
	defer rows.Close()
	var out []ScheduleRow
	for rows.Next() {
		s, err := scanSchedule(rows)
		if err != nil {
			return nil, fmt.Errorf("list schedules: %w", err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list schedules: %w", err)
	}
	return out, nil
}

// Tick is what the caller decided for one due schedule: enqueue its tick (Enqueue) and move
// next_run_at to Next; or, with Err set, record the error and stop the schedule until its spec
// changes.
type Tick struct {
	Enqueue bool
	Next    time.Time
	Err     string
}

// DueSchedules locks up to limit schedules that are due (next_run_at passed) or not armed yet
// (next_run_at NULL) in tx, skipping rows other workers hold, and returns them with the database
// clock. Another worker's transaction that advanced a row first makes it not due any more: each
// tick is handled by exactly one transaction.
func DueSchedules(ctx context.Context, tx pgx.Tx, limit int) ([]ScheduleRow, time.Time, error) {
	var now time.Time
	if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return nil, now, fmt.Errorf("read due schedules: %w", err)
	}
	rows, err := tx.Query(ctx, `
		SELECT `+scheduleColumns+` FROM leash.schedules j
		WHERE next_run_at IS NULL OR next_run_at <= now()
		ORDER BY next_run_at NULLS FIRST
		LIMIT $1
		FOR NO KEY UPDATE SKIP LOCKED`, limit)
	if err != nil {
		return nil, now, fmt.Errorf("read due schedules: %w", err)
	}
	defer rows.Close()
	var out []ScheduleRow
	for rows.Next() {
		s, err := scanSchedule(rows)
		if err != nil {
			return nil, now, fmt.Errorf("read due schedules: %w", err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, now, fmt.Errorf("read due schedules: %w", err)
	}
	return out, now, nil
}

// ApplyTick carries out t for the locked schedule s in tx, in a savepoint, so that one schedule
// that fails leaves the others of the transaction alone: with Err, the error is recorded and the
// schedule stopped; else, when Enqueue is set, the due tick's job is enqueued (run_at = the
// tick), and the schedule moves on to Next. It returns the id of the job enqueued (0: none).
//
// A tick is folded into the job of the schedule's previous tick (last_job_id) while that job has
// not started: still available or retryable, with the schedule's queue and kind (its queue paused
// or capped, no worker serving it, a retry waiting out its backoff). Then no job is enqueued and
// folded is set: that job, once it starts, stands for every tick due meanwhile, as one job stands
// for the ticks missed while no worker ran. It reads last_job_id, which every release that runs
// schedules writes with each tick's job.
func ApplyTick(ctx context.Context, tx pgx.Tx, s ScheduleRow, t Tick) (id int64, folded bool, err error) {
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		switch {
		case t.Err != "":
			_, err := sp.Exec(ctx, `UPDATE leash.schedules SET next_run_at = 'infinity', last_error = $2 WHERE name = $1`,
				s.Name, clean.Text(t.Err, 1024))
			return err
		case !t.Enqueue:
			_, err := sp.Exec(ctx, `UPDATE leash.schedules SET next_run_at = $2 WHERE name = $1`, s.Name, t.Next)
			return err
		}
		err := sp.QueryRow(ctx, `
			INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout)
			SELECT $1, $2, $3::jsonb, $4, $5, $6, $7::interval
			WHERE NOT EXISTS (
				SELECT FROM leash.jobs w
				WHERE w.id = $8 AND w.state IN ('available', 'retryable') AND w.queue = $1 AND w.kind = $2
				  -- Folded only into a job of the same tick values that is due by this tick: one an
				  -- operator postponed (run_at a year on), or one of an edited schedule, does not
				  -- swallow the ticks that follow.
				  AND w.run_at <= $6 AND w.payload = $3::jsonb AND w.priority = $4 AND w.max_attempts = $5)
			RETURNING id`, s.Queue, s.Kind, s.Payload, s.Priority, s.MaxAttempts, *s.NextRunAt, nullInterval(s.Timeout), s.LastJobID,
		).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			folded = true
			_, err = sp.Exec(ctx, `UPDATE leash.schedules SET next_run_at = $2, last_error = NULL WHERE name = $1`, s.Name, t.Next)
			return err
		}
		if err != nil {
			return err
		}
		_, err = sp.Exec(ctx, `
			UPDATE leash.schedules SET next_run_at = $2, last_run_at = $3, last_job_id = $4, last_error = NULL
			WHERE name = $1`, s.Name, t.Next, *s.NextRunAt, id)
		return err
	})
	if err != nil {
		return 0, false, fmt.Errorf("schedule %q: %w", s.Name, err)
	}
	return id, folded, nil
}

// SkipTick moves a schedule whose tick could not be enqueued on to next, recording why; if even
// that cannot be written (next out of range, ...), it stops the schedule with the error. Each in
// a savepoint: only a failure to write the error itself fails tx.
func SkipTick(ctx context.Context, tx pgx.Tx, name string, next time.Time, why string) error {
	why = clean.Text(why, 1024)
	err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		_, err := sp.Exec(ctx, `UPDATE leash.schedules SET next_run_at = $2, last_error = $3 WHERE name = $1`, name, next, why)
		return err
	})
	if err == nil {
		return nil
	}
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		_, err := sp.Exec(ctx, `UPDATE leash.schedules SET next_run_at = 'infinity', last_error = $2 WHERE name = $1`,
			name, clean.Text(why+"; then: "+err.Error(), 1024))
		return err
	})
	if err != nil {
		return fmt.Errorf("skip tick of schedule %q: %w", name, err)
	}
	return nil
}

// NextScheduleIn returns how long until the earliest armed schedule is due (database clock), at
// most limit, or false when none is armed ('infinity': stopped). next_run_at may hold anything
// SQL can write: a date past 2262 (9999-12-31, how Never reads) is further off than a
// time.Duration reaches, so the wait is bounded in SQL, before it becomes a number.
func NextScheduleIn(ctx context.Context, db DBTX, limit time.Duration) (time.Duration, bool, error) {
	limit = max(limit, 0)
	var ms *int64
	err := db.QueryRow(ctx, `
		SELECT CASE WHEN bool_or(next_run_at IS NULL) THEN 0
		            WHEN min(next_run_at) IS NOT NULL THEN ceil(extract(epoch FROM
		                 greatest(least(min(next_run_at), now() + $1::interval), now()) - now()) * 1000)::bigint END
		FROM leash.schedules
		WHERE next_run_at IS NULL OR next_run_at < 'infinity'`, interval(limit)).Scan(&ms)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && ms == nil) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read next schedule: %w", err)
	}
	return time.Duration(min(max(*ms, 0), limit.Milliseconds())) * time.Millisecond, true, nil
}
