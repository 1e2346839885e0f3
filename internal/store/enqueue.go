package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
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
	// ConcurrencyKey is the job's key for its queue's per-key limit; empty stores NULL (no key).
	ConcurrencyKey string
}

func (p *InsertParams) scheduled() bool { return !p.RunAt.IsZero() || p.Delay > 0 }

// The statements of this file run on the application's own connections, often in its own
// transactions, so that nothing the session sets may change what they mean: every function and
// every operator on text and timestamps is named in pg_catalog (a search_path of
// "public, pg_catalog" would otherwise pick a public.now() or a public.= first; OPERATOR(...)
// binds like any other operator, hence the parentheses around arithmetic). Durations and absent
// values come as typed parameters (an interval, NULL) rather than as arithmetic on numbers.

// onKeyConflict is the conflict target of every unique insert: the partial unique index
// jobs_unique_key_idx, whose predicate it repeats. A held key inserts nothing; any other conflict,
// such as a primary key taken because the id sequence is behind the table, is an error.
const onKeyConflict = `
	ON CONFLICT (unique_key)
		WHERE unique_key IS NOT NULL AND state OPERATOR(pg_catalog.=) ANY (ARRAY['available', 'retryable', 'running'])
		DO NOTHING`

// insertPlainSQL adds one job without a unique key.
const insertPlainSQL = `
	INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, trace_context, concurrency_key)
	VALUES ($1, $2, coalesce($3::pg_catalog.jsonb, '{}'), $4, $5,
	        coalesce($6, pg_catalog.now() OPERATOR(pg_catalog.+) $7::interval), $8::interval, $9::pg_catalog.jsonb,
	        $10::pg_catalog.text)
	RETURNING id`

// insertSQL adds one job unless its unique key $9 is taken: by an unfinished job (the partial
// unique index) or, when $10 is not NULL, by a job finished less than $10 ago. It returns no row
// when the key is taken.
const insertSQL = `
	INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, unique_key, trace_context, concurrency_key)
	SELECT $1, $2, coalesce($3::pg_catalog.jsonb, '{}'), $4, $5,
	       coalesce($6, pg_catalog.now() OPERATOR(pg_catalog.+) $7::interval), $8::interval, $9, $11::pg_catalog.jsonb,
	       $12::pg_catalog.text
	WHERE $10::interval IS NULL OR NOT EXISTS (
		SELECT FROM leash.jobs f
		WHERE f.unique_key OPERATOR(pg_catalog.=) $9
		  AND f.state OPERATOR(pg_catalog.=) ANY (ARRAY['completed', 'failed', 'cancelled'])
		  AND f.finished_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) $10::interval))` +
	onKeyConflict + `
	RETURNING id`

// existingSQL finds the job that holds a unique key: the unfinished one, else (when $2 is not
// NULL) the one finished last less than $2 ago.
const existingSQL = `
	(SELECT id FROM leash.jobs
	 WHERE unique_key OPERATOR(pg_catalog.=) $1
	   AND state OPERATOR(pg_catalog.=) ANY (ARRAY['available', 'retryable', 'running']))
	UNION ALL
	(SELECT id FROM leash.jobs
	 WHERE $2::interval IS NOT NULL AND unique_key OPERATOR(pg_catalog.=) $1
	   AND state OPERATOR(pg_catalog.=) ANY (ARRAY['completed', 'failed', 'cancelled'])
	   AND finished_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) $2::interval)
	 ORDER BY finished_at DESC LIMIT 1)
	LIMIT 1`

// ErrHolderNotVisible is returned, with duplicate set, by an insert whose unique key is held by a
// job committed after the snapshot of db's REPEATABLE READ or SERIALIZABLE transaction: nothing
// was inserted, the transaction stays usable, but it cannot read that job.
var ErrHolderNotVisible = errors.New("the job holding the unique key was committed after this transaction's snapshot")

// interval is d as a PostgreSQL interval, to the millisecond (as the columns keep it).
func interval(d time.Duration) pgtype.Interval {
	return pgtype.Interval{Microseconds: millis(d) * 1000, Valid: true}
}

// nullInterval is d as an interval of whole milliseconds, rounded up like every duration leash
// stores (see millis), so that no positive duration reads as none; NULL when not positive.
func nullInterval(d time.Duration) pgtype.Interval {
	return pgtype.Interval{Microseconds: max(millis(d), 0) * 1000, Valid: d > 0}
}

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
// inserts nothing and returns that job's id with duplicate set; or, when that job was committed
// after the snapshot of db's REPEATABLE READ or SERIALIZABLE transaction, id 0 with duplicate set
// and ErrHolderNotVisible. Either way db's transaction stays usable: in such a transaction the
// insert runs in a savepoint (ON CONFLICT raises a serialization failure, 40001, when the row it
// conflicts with is not in the snapshot), which a READ COMMITTED transaction does not need.
func InsertUnique(ctx context.Context, db DBTX, p InsertParams) (id int64, duplicate bool, err error) {
	var runAt *time.Time
	if !p.RunAt.IsZero() {
		runAt = &p.RunAt
	}
	if p.UniqueKey == "" {
		err = db.QueryRow(ctx, insertPlainSQL,
			p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, interval(p.Delay), nullInterval(p.Timeout),
			nullJSON(p.TraceContext), nullText(p.ConcurrencyKey),
		).Scan(&id)
		if err != nil {
			return 0, false, explainInsertError("insert job", err)
		}
		return id, false, nil
	}
	snapshot, err := snapshotTx(ctx, db)
	if err != nil {
		return 0, false, fmt.Errorf("insert job: %w", err)
	}
	args := []any{p.Queue, p.Kind, nullJSON(p.Payload), p.Priority, p.MaxAttempts, runAt, interval(p.Delay),
		nullInterval(p.Timeout), p.UniqueKey, nullInterval(p.UniqueWithin), nullJSON(p.TraceContext), nullText(p.ConcurrencyKey)}
	// The holder of a key can finish between the insert and the lookup: then try again.
	for range 5 {
		if snapshot {
			err = inSavepoint(ctx, db, func() error { return db.QueryRow(ctx, insertSQL, args...).Scan(&id) })
		} else {
			err = db.QueryRow(ctx, insertSQL, args...).Scan(&id)
		}
		switch {
		case err == nil:
			return id, false, nil
		case heldAfterSnapshot(err) && snapshot:
			return 0, true, fmt.Errorf("insert job: unique key %q: %w", p.UniqueKey, ErrHolderNotVisible)
		case heldAfterSnapshot(err):
			continue // a statement of its own (default_transaction_isolation): the next one sees the holder
		case !errors.Is(err, pgx.ErrNoRows):
			return 0, false, explainInsertError("insert job", err)
		}
		err = db.QueryRow(ctx, existingSQL, p.UniqueKey, nullInterval(p.UniqueWithin)).Scan(&id)
		if err == nil {
			return id, true, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, false, fmt.Errorf("insert job: find the job holding its unique key: %w", err)
		}
	}
	return 0, false, fmt.Errorf("insert job: unique key %q was taken and freed five times in a row", p.UniqueKey)
}

// explainInsertError wraps an insert's error; a taken primary key gets its cause and its cure.
// Ids come from the column's identity sequence, so one is taken only when the sequence is behind
// the table's ids: after a restore of the table without its sequence, or a failover to a logical
// replica (logical replication does not carry sequences).
func explainInsertError(what string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == "jobs_pkey" {
		return fmt.Errorf("%s: the job id the sequence gave is taken: the sequence of leash.jobs.id is behind the "+
			"table's ids (after a restore or a failover?); move it past them with "+
			"SELECT setval(pg_get_serial_sequence('leash.jobs', 'id'), max(id)) FROM leash.jobs: %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// heldAfterSnapshot reports the error ON CONFLICT raises under REPEATABLE READ and SERIALIZABLE
// when the row that holds the key was committed after the transaction's snapshot ("could not
// serialize access due to concurrent update"). The serialization failures of SERIALIZABLE's own
// conflict tracking carry a "Reason code" detail: those are errors like any other.
func heldAfterSnapshot(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "40001" && !strings.HasPrefix(pe.Detail, "Reason code")
}

// snapshotTx reports whether db is in a transaction that reads from one snapshot (REPEATABLE READ
// or SERIALIZABLE). A pool, or a connection outside a transaction, runs each statement on its own.
func snapshotTx(ctx context.Context, db DBTX) (bool, error) {
	switch d := db.(type) {
	case *pgxpool.Pool:
		return false, nil
	case *pgx.Conn:
		if d.PgConn().TxStatus() == 'I' {
			return false, nil
		}
	case interface{ Conn() *pgx.Conn }: // pgx.Tx, *pgxpool.Conn
		if d.Conn().PgConn().TxStatus() == 'I' {
			return false, nil
		}
	}
	var iso string
	if err := db.QueryRow(ctx, `SELECT pg_catalog.current_setting('transaction_isolation')`).Scan(&iso); err != nil {
		return false, fmt.Errorf("read the transaction's isolation level: %w", err)
	}
	return iso == "repeatable read" || iso == "serializable", nil
}

// inSavepoint runs f in a savepoint of db's transaction: when f fails, the savepoint is rolled back
// and the transaction goes on. (db may be a connection on which the application began the
// transaction itself, so this does not use pgx's nested transactions.)
func inSavepoint(ctx context.Context, db DBTX, f func() error) error {
	if _, err := db.Exec(ctx, `SAVEPOINT leash_insert`); err != nil {
		return err
	}
	if err := f(); err != nil {
		if _, rerr := db.Exec(ctx, `ROLLBACK TO SAVEPOINT leash_insert; RELEASE SAVEPOINT leash_insert`); rerr != nil {
			return fmt.Errorf("%w (then rolling back to its savepoint failed too: %v)", err, rerr)
		}
		return err
	}
	_, err := db.Exec(ctx, `RELEASE SAVEPOINT leash_insert`)
	return err
}

// insertManyUniqueSQL adds many jobs in one statement, skipping each whose unique key is taken
// (including by an earlier row of the same statement). COPY cannot skip conflicts.
const insertManyUniqueSQL = `
	INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, unique_key, trace_context, concurrency_key)
	SELECT r.queue, r.kind, r.payload::pg_catalog.jsonb, r.priority, r.max_attempts,
	       coalesce(r.run_at, pg_catalog.now() OPERATOR(pg_catalog.+) r.delay), r.timeout, r.unique_key,
	       r.trace_context::pg_catalog.jsonb, r.concurrency_key
	FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[]), pg_catalog.unnest($3::pg_catalog.text[]),
	                pg_catalog.unnest($4::smallint[]), pg_catalog.unnest($5::int[]), pg_catalog.unnest($6::pg_catalog.timestamptz[]),
	                pg_catalog.unnest($7::interval[]), pg_catalog.unnest($8::interval[]), pg_catalog.unnest($9::pg_catalog.text[]),
	                pg_catalog.unnest($10::interval[]), pg_catalog.unnest($11::pg_catalog.text[]), pg_catalog.unnest($12::pg_catalog.text[]))
	     AS r(queue, kind, payload, priority, max_attempts, run_at, delay, timeout, unique_key, within, trace_context, concurrency_key)
	WHERE r.within IS NULL OR NOT EXISTS (
		SELECT FROM leash.jobs f
		WHERE f.unique_key OPERATOR(pg_catalog.=) r.unique_key
		  AND f.state OPERATOR(pg_catalog.=) ANY (ARRAY['completed', 'failed', 'cancelled'])
		  AND f.finished_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) r.within))` +
	onKeyConflict

// insertManyUnique adds jobs of which some have unique keys, in one statement; it returns how
// many it inserted (the others were duplicates). The statement is all or nothing; in a REPEATABLE
// READ or SERIALIZABLE transaction it runs in a savepoint, and a key held by a job committed after
// the snapshot fails it with ErrHolderNotVisible, leaving the transaction usable.
func insertManyUnique(ctx context.Context, db DBTX, ps []InsertParams) (int64, error) {
	n := len(ps)
	queues, kinds, payloads := make([]string, n), make([]string, n), make([]string, n)
	keys, traces, ckeys := make([]*string, n), make([]*string, n), make([]*string, n)
	prios, attempts := make([]int16, n), make([]int32, n)
	runAts := make([]*time.Time, n)
	delays, timeouts, withins := make([]pgtype.Interval, n), make([]pgtype.Interval, n), make([]pgtype.Interval, n)
	for i := range ps {
		p := &ps[i]
		if p.TraceContext != nil {
			tc := string(p.TraceContext)
			traces[i] = &tc
		}
		if p.UniqueKey != "" {
			keys[i] = &p.UniqueKey
		}
		if p.ConcurrencyKey != "" {
			ckeys[i] = &p.ConcurrencyKey
		}
		queues[i], kinds[i] = p.Queue, p.Kind
		payloads[i] = "{}"
		if p.Payload != nil {
			payloads[i] = string(p.Payload)
		}
		prios[i], attempts[i] = p.Priority, p.MaxAttempts
		if !p.RunAt.IsZero() {
			runAts[i] = &p.RunAt
		}
		delays[i], timeouts[i], withins[i] = interval(p.Delay), nullInterval(p.Timeout), nullInterval(p.UniqueWithin)
	}
	snapshot, err := snapshotTx(ctx, db)
	if err != nil {
		return 0, fmt.Errorf("insert jobs with unique keys: nothing was inserted: %w", err)
	}
	var inserted int64
	insert := func() error {
		tag, err := db.Exec(ctx, insertManyUniqueSQL, queues, kinds, payloads, prios, attempts, runAts, delays, timeouts,
			keys, withins, traces, ckeys)
		inserted = tag.RowsAffected()
		return err
	}
	if snapshot {
		err = inSavepoint(ctx, db, insert)
	} else {
		err = insert()
	}
	if heldAfterSnapshot(err) && snapshot {
		return 0, fmt.Errorf("insert jobs with unique keys: nothing was inserted: %w; the transaction stays usable", ErrHolderNotVisible)
	}
	if err != nil {
		return 0, explainInsertError("insert jobs with unique keys: nothing was inserted", err)
	}
	return inserted, nil
}

// nullText is s, or NULL when it is empty.
func nullText(s string) any {
	if s == "" {
		return nil
	}
	return s
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
// unique keys go in one INSERT ... ON CONFLICT (unique_key) DO NOTHING instead, which skips
// duplicates and counts only the jobs it inserted. When any job is scheduled, all run_at values
// are computed from the database clock read once in the same transaction. Either way the batch
// is all or nothing: an error means nothing was inserted.
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
	scheduled, timeouts, traces, ckeys := false, false, false, false
	for i := range ps {
		scheduled = scheduled || ps[i].scheduled()
		timeouts = timeouts || ps[i].Timeout > 0
		traces = traces || ps[i].TraceContext != nil
		ckeys = ckeys || ps[i].ConcurrencyKey != ""
	}
	cols := []string{"queue", "kind", "payload", "priority", "max_attempts"}
	if timeouts {
		cols = append(cols, "timeout")
	}
	if traces {
		cols = append(cols, "trace_context")
	}
	if ckeys {
		cols = append(cols, "concurrency_key")
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
		if ckeys {
			r = append(r, nullText(p.ConcurrencyKey))
		}
		return r
	}
	table := pgx.Identifier{"leash", "jobs"}
	if !scheduled {
		n, err := db.CopyFrom(ctx, table, cols, pgx.CopyFromSlice(len(ps), func(i int) ([]any, error) {
			return row(&ps[i]), nil
		}))
		if err != nil {
			return 0, explainInsertError("copy jobs: nothing was inserted", err)
		}
		return n, nil
	}
	var n int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var now time.Time
		if err := tx.QueryRow(ctx, "SELECT pg_catalog.now()").Scan(&now); err != nil {
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
			return explainInsertError("copy jobs: nothing was inserted", err)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}
