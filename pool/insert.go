package pool

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leashq/leash/internal/store"
)

// DB is what inserts need: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// InsertOpts are the optional settings of a new job.
type InsertOpts struct {
	// Queue. Default QueueDefault.
	Queue string
	// Priority: lower runs first. Default 0.
	Priority int16
	// RunAt schedules the job; zero means now. It must lie in PostgreSQL's range (4714 BC to
	// 294276 AD): a time outside it is refused rather than stored as another.
	RunAt time.Time
	// Delay schedules the job this long from now on the database clock (when RunAt is zero).
	Delay time.Duration
	// MaxAttempts before the job fails for good. Default MaxAttemptsDefault (20, as the table's).
	MaxAttempts int
	// Timeout limits one attempt: past it the handler's context is cancelled with ErrTimeout
	// and the attempt fails like an error. Zero: the kind's default (Config.Timeouts), if any.
	Timeout time.Duration
	// UniqueKey, when set, makes the job unique among unfinished jobs (available, retryable,
	// running) with the same key, whatever their kind or queue: while one exists, Insert inserts
	// nothing and returns that job's id with an error matching ErrDuplicate. Once the job
	// finishes, the key is free again. Enforced by a unique index, so it holds against concurrent
	// producers and SQL clients alike. At most 1024 bytes of valid UTF-8 without NUL.
	UniqueKey string
	// UniqueFinishedWithin extends UniqueKey to jobs that finished (completed, failed or
	// cancelled) less than this long ago, on the database clock: a job that ran recently
	// dedupes too. Zero: only unfinished jobs count. Checked in the inserting statement's own
	// snapshot, so a job finishing at that very moment may let one insert through.
	UniqueFinishedWithin time.Duration
	// TraceContext is the enqueuer's W3C trace context carrier ("traceparent", "tracestate"),
	// stored in the job's trace_context column for tracing workers; see TraceContext on Job.
	// Usually filled from ctx by the helpers of module github.com/leashq/leash/otel. Nil stores
	// NULL. Keys and values must be valid UTF-8 without NUL bytes, MaxTraceContextBytes at most
	// as JSON.
	TraceContext map[string]string
	// ConcurrencyKey is the job's key (a customer, a tenant, an account) for its queue's per-key
	// limit (SetQueueMaxRunningPerKey): at most that many jobs of one key of the queue hold the
	// key at once across all workers, each from its first start until it is finished, and they
	// start in the key's (priority, run_at, id) order. Empty: no key (the job is limited only by
	// the queue's own settings). At most 1024 bytes of valid UTF-8 without NUL. A queue without a
	// per-key limit ignores it.
	ConcurrencyKey string
}

// ErrDuplicate is matched (errors.Is) by the error of an insert skipped because another job holds
// its unique key; errors.As with *DuplicateError gives that job's id.
var ErrDuplicate = errors.New("duplicate job")

// ErrDuplicateNotVisible is matched (errors.Is), besides ErrDuplicate, when the job holding the
// key was committed after the snapshot of the caller's REPEATABLE READ or SERIALIZABLE
// transaction: nothing was inserted and the transaction stays usable, but the transaction cannot
// read that job, so DuplicateError.ID is 0. (Under SERIALIZABLE, the transaction may still fail
// to commit as usual.) InsertMany returns it when any job of the batch meets such a key: then
// nothing of the batch was inserted.
var ErrDuplicateNotVisible = errors.New("the job holding the unique key was committed after this transaction's snapshot")

// DuplicateError says which job holds the unique key an insert asked for.
type DuplicateError struct {
	Key string
	ID  int64 // the job holding the key; 0 when NotVisible
	// NotVisible: the job holding the key was committed after the snapshot of the caller's
	// REPEATABLE READ or SERIALIZABLE transaction, which cannot read it (ErrDuplicateNotVisible).
	NotVisible bool
}

func (e *DuplicateError) Error() string {
	if e.NotVisible {
		return fmt.Sprintf("duplicate job: unique key %q is held by a job committed after this transaction's snapshot",
			truncateForError(e.Key))
	}
	return fmt.Sprintf("duplicate job: unique key %q is held by job %d", truncateForError(e.Key), e.ID)
}

// Is makes errors.Is(err, ErrDuplicate) true, and errors.Is(err, ErrDuplicateNotVisible) when
// NotVisible.
func (e *DuplicateError) Is(target error) bool {
	return target == ErrDuplicate || (e.NotVisible && target == ErrDuplicateNotVisible)
}

// ErrInvalidJob wraps every rejection of a job before it reaches the database.
var ErrInvalidJob = errors.New("invalid job")

func params(kind string, payload any, opts *InsertOpts) (store.InsertParams, error) {
	var o InsertOpts
	if opts != nil {
		o = *opts
	}
	if kind == "" {
		return store.InsertParams{}, fmt.Errorf("%w: kind is empty", ErrInvalidJob)
	}
	if utf8.RuneCountInString(kind) > 128 {
		return store.InsertParams{}, fmt.Errorf("%w: kind is longer than 128 characters", ErrInvalidJob)
	}
	if utf8.RuneCountInString(o.Queue) > 128 {
		return store.InsertParams{}, fmt.Errorf("%w: queue is longer than 128 characters", ErrInvalidJob)
	}
	if o.Delay < 0 {
		return store.InsertParams{}, fmt.Errorf("%w: delay %s is negative", ErrInvalidJob, o.Delay)
	}
	if !o.RunAt.IsZero() && (o.RunAt.Before(minRunAt) || !o.RunAt.Before(maxRunAt)) {
		return store.InsertParams{}, fmt.Errorf("%w: run at %s is outside PostgreSQL's range (4714 BC to 294276 AD)", ErrInvalidJob, o.RunAt)
	}
	if o.Timeout < 0 || (o.Timeout > 0 && o.Timeout < time.Millisecond) || o.Timeout > MaxTimeout {
		return store.InsertParams{}, fmt.Errorf("%w: timeout %s must be between 1ms and %s", ErrInvalidJob, o.Timeout, MaxTimeout)
	}
	if !validName(kind) || !validName(o.Queue) {
		return store.InsertParams{}, fmt.Errorf("%w: kind and queue must be valid UTF-8 without NUL bytes", ErrInvalidJob)
	}
	if o.UniqueKey != "" && (len(o.UniqueKey) > 1024 || !validName(o.UniqueKey)) {
		return store.InsertParams{}, fmt.Errorf("%w: unique key must be at most 1024 bytes of valid UTF-8 without NUL", ErrInvalidJob)
	}
	if o.ConcurrencyKey != "" && (len(o.ConcurrencyKey) > MaxConcurrencyKeyBytes || !validName(o.ConcurrencyKey)) {
		return store.InsertParams{}, fmt.Errorf("%w: concurrency key must be at most %d bytes of valid UTF-8 without NUL",
			ErrInvalidJob, MaxConcurrencyKeyBytes)
	}
	if o.UniqueFinishedWithin < 0 || (o.UniqueFinishedWithin > 0 && o.UniqueKey == "") {
		return store.InsertParams{}, fmt.Errorf("%w: UniqueFinishedWithin needs a UniqueKey and must not be negative", ErrInvalidJob)
	}
	if o.MaxAttempts < 0 || o.MaxAttempts > 1000 {
		return store.InsertParams{}, fmt.Errorf("%w: max attempts %d is not between 1 and 1000", ErrInvalidJob, o.MaxAttempts)
	}
	body, err := encodePayload(payload)
	if err != nil {
		return store.InsertParams{}, fmt.Errorf("%w: kind %s: %v", ErrInvalidJob, kind, err)
	}
	trace, err := encodeTraceContext(o.TraceContext)
	if err != nil {
		return store.InsertParams{}, fmt.Errorf("%w: kind %s: %v", ErrInvalidJob, kind, err)
	}
	return store.InsertParams{Queue: cmp.Or(o.Queue, QueueDefault), Kind: kind, Payload: body, Priority: o.Priority,
		MaxAttempts: int32(cmp.Or(o.MaxAttempts, MaxAttemptsDefault)), RunAt: o.RunAt, Delay: o.Delay, Timeout: o.Timeout,
		UniqueKey: o.UniqueKey, UniqueWithin: o.UniqueFinishedWithin, TraceContext: trace, ConcurrencyKey: o.ConcurrencyKey}, nil
}

// MaxConcurrencyKeyBytes bounds InsertOpts.ConcurrencyKey, as the table's check does.
const MaxConcurrencyKeyBytes = 1024

// minRunAt and maxRunAt bound what a timestamptz holds. Beyond them, the driver's conversion to
// microseconds overflows for the furthest times: year -300000 would be stored as year 284554.
var (
	minRunAt = time.Date(-4713, time.November, 24, 0, 0, 0, 0, time.UTC)
	maxRunAt = time.Date(294277, time.January, 1, 0, 0, 0, 0, time.UTC)
)

// validName reports whether s can be stored as PostgreSQL text.
func validName(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

func encodePayload(payload any) ([]byte, error) {
	switch p := payload.(type) {
	case nil:
		return nil, nil
	case json.RawMessage:
		if !json.Valid(p) {
			return nil, errors.New("payload is not valid JSON")
		}
		return p, nil
	case []byte:
		if !json.Valid(p) {
			return nil, errors.New("payload is not valid JSON")
		}
		return p, nil
	}
	b, err := json.Marshal(payload)
	if err != nil {
		return nil, fmt.Errorf("payload does not marshal to JSON: %w", err)
	}
	return b, nil
}

// Insert enqueues one job and returns its id. payload is any value that marshals to JSON
// (json.RawMessage and []byte are taken as JSON text); nil means {}. With opts.UniqueKey held by
// another job, it returns that job's id and a *DuplicateError (errors.Is(err, ErrDuplicate)).
func Insert(ctx context.Context, db DB, kind string, payload any, opts *InsertOpts) (int64, error) {
	p, err := params(kind, payload, opts)
	if err != nil {
		return 0, err
	}
	id, dup, err := store.InsertUnique(ctx, db, p)
	switch {
	case dup:
		return id, &DuplicateError{Key: p.UniqueKey, ID: id, NotVisible: errors.Is(err, store.ErrHolderNotVisible)}
	case err != nil:
		return 0, err
	}
	return id, nil
}

// InsertTx enqueues one job inside the caller's transaction: it becomes visible, and wakes
// workers, only when tx commits. A duplicate (ErrDuplicate) leaves tx usable, under every
// isolation level: under READ COMMITTED nothing fails in the database; under REPEATABLE READ and
// SERIALIZABLE a job with a unique key is inserted in a savepoint, since PostgreSQL fails an
// ON CONFLICT that meets a row committed after the transaction's snapshot; such a duplicate
// matches ErrDuplicateNotVisible and has no id. A primary-key conflict (the id sequence behind
// the table, as after a restore) is an error, never a duplicate.
func InsertTx(ctx context.Context, tx pgx.Tx, kind string, payload any, opts *InsertOpts) (int64, error) {
	return Insert(ctx, tx, kind, payload, opts)
}

// InsertManyParams is one job of a bulk insert. With Kind empty and a Payload that is a JobArgs,
// the job's kind is the payload's Kind().
type InsertManyParams struct {
	Kind    string
	Payload any
	Opts    *InsertOpts
}

// CopyDB is what InsertMany needs: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type CopyDB interface {
	Beginner
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

// InsertMany enqueues many jobs with one COPY and returns how many it inserted. Workers are woken
// once per queue, however many rows. Nothing is inserted if any job is invalid, and an error
// always means that nothing of the batch was inserted. When any job has a UniqueKey, a COPY
// cannot be used (it cannot skip conflicts, and one duplicate would fail the whole batch): the
// jobs go in one INSERT ... ON CONFLICT (unique_key) DO NOTHING instead, duplicates (of existing
// jobs or of an earlier job in the same call) are skipped, and the count excludes them; in a
// REPEATABLE READ or SERIALIZABLE transaction, a key held by a job committed after the snapshot
// fails the batch with ErrDuplicateNotVisible instead, leaving the transaction usable.
func InsertMany(ctx context.Context, db CopyDB, jobs []InsertManyParams) (int64, error) {
	ps := make([]store.InsertParams, len(jobs))
	for i, j := range jobs {
		if a, ok := j.Payload.(JobArgs); ok && j.Kind == "" {
			kind, err := argsKind(a)
			if err != nil {
				return 0, fmt.Errorf("job %d: %w", i, err)
			}
			j.Kind = kind
		}
		p, err := params(j.Kind, j.Payload, j.Opts)
		if err != nil {
			return 0, fmt.Errorf("job %d: %w", i, err)
		}
		ps[i] = p
	}
	n, err := store.InsertMany(ctx, db, ps)
	return n, matchAlso(err, store.ErrHolderNotVisible, ErrDuplicateNotVisible)
}

// Beginner starts transactions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx (which begins a
// savepoint).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate applies leash's pending schema migrations under an advisory lock and returns the
// migrations it applied, in order, also when it fails part-way (those before the failure are
// committed). Safe to run at every start, from many processes at once. It is MigrateWith with
// no options.
func Migrate(ctx context.Context, db Beginner) ([]Migration, error) {
	return MigrateWith(ctx, db, MigrateOptions{})
}
