package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
)

// ErrFenced means a fenced write found that this claim no longer holds the job: it was taken
// over, revoked and finished, or its lease stopped being trusted. Nothing was written.
var ErrFenced = errors.New("lease token no longer holds")

// ErrRowBusy means SetProgress could not lock the job's row in time because another transaction
// was writing it (an operator's UPDATE, or a transaction of the handler's that updates the row
// itself; Fence, SetProgressTx and CompleteTx do not hold it so).
var ErrRowBusy = errors.New("job row locked by another transaction")

// Job is one claimed attempt of a job, handed to its Handler. Its fields are the handler's copy
// of the claimed row: leash fences, settles, logs and reports the attempt from its own record of
// the claim, so a handler that changes a field (ID, Token, Attempt, Kind...) changes only what it
// reads itself.
type Job struct {
	ID          int64
	Queue       string
	Kind        string
	Payload     json.RawMessage
	Priority    int16
	Attempt     int
	MaxAttempts int
	// Token is this claim's fencing token.
	Token     int64
	CreatedAt time.Time
	// RunAt is when the job became runnable (scheduled time, or retry time).
	RunAt       time.Time
	AttemptedAt time.Time
	// TraceContext is the W3C trace context carrier the job was enqueued with (InsertOpts.
	// TraceContext, or the trace_context column written by any client); nil when there is none
	// or the column held something else than an object of strings.
	TraceContext map[string]string
	// ConcurrencyKey is the job's key for its queue's per-key limit; empty when it has none.
	ConcurrencyKey string

	// claim is the claimed row as read, which leash's own writes, events and logs use: the
	// exported fields above are the handler's copy, and changing them changes nothing leash does.
	claim     store.ClaimedJob
	lease     *leasekeeper.Lease // &held
	held      leasekeeper.Lease  // the lease, in the job's own allocation
	err       error              // what the handler returned, for AttemptObserver
	db        DB
	doneInTx  atomic.Bool
	fenced    atomic.Bool // a fenced write was staged in some transaction of the handler's
	started   time.Time
	stallSeen time.Time
	timer     *time.Timer // the attempt's timeout, if any
	output    atomic.Pointer[[]byte]
	info      attemptInfo // what the handler's context carries (see Logger)
	ctx       attemptCtx  // the handler's context
}

// newJob is the attempt of the claimed row cj; its lease, j.lease, is to be held (Keeper.HoldIn).
func newJob(cj store.ClaimedJob, db DB) *Job {
	j := &Job{ID: cj.ID, Queue: cj.Queue, Kind: cj.Kind, Payload: cj.Payload, Priority: cj.Priority,
		Attempt: int(cj.Attempt), MaxAttempts: int(cj.MaxAttempts), Token: cj.Token, CreatedAt: cj.CreatedAt,
		RunAt: cj.RunAt, AttemptedAt: cj.AttemptedAt, TraceContext: decodeTraceContext(cj.TraceContext),
		ConcurrencyKey: cj.ConcurrencyKey, claim: cj, db: db, started: time.Now()}
	j.lease = &j.held
	return j
}

// MaxOutputBytes bounds the JSON a handler may record with SetOutput.
const MaxOutputBytes = 64 << 10

// SetOutput records v (marshalled to JSON, at most MaxOutputBytes) as the job's result. It is
// written to the job's output column with the attempt's outcome, under the same fence: an
// attempt that lost its lease writes no output, and a later call replaces an earlier one. With
// CompleteTx, call it before: CompleteTx writes it in the same transaction. Nothing is written
// until the handler returns (or CompleteTx runs), so it costs no round trip.
func (j *Job) SetOutput(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("set output of job %d: %w", j.claim.ID, err)
	}
	if len(b) > MaxOutputBytes {
		return fmt.Errorf("set output of job %d: %d bytes of JSON, more than the %d allowed", j.claim.ID, len(b), MaxOutputBytes)
	}
	if b, err = store.CleanJSON(b); err != nil {
		return fmt.Errorf("set output of job %d: %w", j.claim.ID, err)
	}
	j.output.Store(&b)
	return nil
}

// recordedOutput is what SetOutput recorded, or nil.
func (j *Job) recordedOutput() []byte {
	if b := j.output.Load(); b != nil {
		return *b
	}
	return nil
}

// EnsureActive returns nil while this claim's lease is safe for writes, and the lease's cause
// (lease.ErrRevoked, lease.ErrLost, lease.ErrRenewalTimeout, lease.ErrShutdown) once not. Call
// it before a side effect outside the database; the handler's context is cancelled with the same
// cause.
func (j *Job) EnsureActive() error { return j.lease.EnsureActive() }

// Fence locks the job's row in tx and fails (wrapping ErrFenced and the lease's cause) unless
// this claim still holds it unrevoked, so the handler's own writes in tx commit only under a
// live lease: a worker that lost the job can no longer commit in its name, and a revocation
// committed before the fence wins (it also cancels the handler's context). The lock keeps every
// takeover off the job while tx lasts, yet lets its lease be renewed, however long tx takes, and
// lets a revocation through at once: the handler's context is cancelled with lease.ErrRevoked,
// and tx's commit then fails (SQLSTATE LR001; LR002 if the claim lost the job), so nothing of tx
// commits after a revocation did. Write the job's own row only through SetProgressTx and
// CompleteTx: an UPDATE of leash.jobs in tx holds the row against renewals and revocations
// until tx ends. tx's isolation level is the application's: under REPEATABLE READ or
// SERIALIZABLE, a row renewed after tx took its snapshot fails the fence, and tx's commit, with
// a serialization failure (SQLSTATE 40001), never with a stale success. The lease is renewed
// every HeartbeatInterval, so such a transaction commits only if it ends before the next
// renewal: fence first in tx, keep tx short, retry on 40001, and run long fenced transactions
// under READ COMMITTED, where renewals go on beside them. A transaction prepared for two-phase
// commit (PREPARE TRANSACTION) holds the row against renewals and revocations until it is
// committed or rolled back.
func (j *Job) Fence(ctx context.Context, tx pgx.Tx) error {
	if err := j.lease.EnsureActive(); err != nil {
		return fmt.Errorf("fence job %d: %w: %w", j.claim.ID, ErrFenced, err)
	}
	j.fenced.Store(true) // before the statement: a revocation arriving meanwhile must see it
	if err := j.rowError(store.Fence(ctx, tx, j.claim.ID, j.claim.Token)); err != nil {
		return fmt.Errorf("fence job %d token %d: %w", j.claim.ID, j.claim.Token, err)
	}
	return nil
}

// rowError maps what a fenced statement found in the row: a revocation ends the lease (and so
// cancels the handler) and reads as ErrFenced wrapping lease.ErrRevoked.
func (j *Job) rowError(err error) error {
	switch {
	case errors.Is(err, store.ErrRevokedRow):
		j.lease.End(lease.ErrRevoked)
		return fmt.Errorf("%w: %w", ErrFenced, lease.ErrRevoked)
	case errors.Is(err, store.ErrFenced):
		return ErrFenced
	case errors.Is(err, store.ErrRowBusy):
		return fmt.Errorf("job %d: %w", j.claim.ID, ErrRowBusy)
	}
	return err
}

// CompleteTx marks the job completed inside tx, fenced by its token, so the handler's effects
// and the completion commit together or not at all (exactly once for work in the same
// database). A revocation committed before it wins: it fails wrapping ErrFenced and
// lease.ErrRevoked, and tx should roll back; one that commits after it makes tx's commit fail.
// The completion is written by tx's commit, so the row reads as running inside tx. After a
// CompleteTx the worker never writes a completion itself: if the handler returns an error, that
// error's outcome is written, and if it returns success, a retry is (the completion in tx did not
// commit: tx, or a savepoint holding the CompleteTx, rolled back, or a failover undid it). Either
// is fenced by the token, so a job tx completed stays completed.
func (j *Job) CompleteTx(ctx context.Context, tx pgx.Tx) error {
	if err := j.lease.EnsureActive(); err != nil {
		return fmt.Errorf("complete job %d: %w: %w", j.claim.ID, ErrFenced, err)
	}
	j.fenced.Store(true)
	if err := j.rowError(store.CompleteTx(ctx, tx, j.claim.ID, j.claim.Token, j.recordedOutput())); err != nil {
		return fmt.Errorf("complete job %d: %w", j.claim.ID, err)
	}
	j.doneInTx.Store(true)
	return nil
}

// SetProgress stores v (marshalled to JSON) as the job's checkpoint, fenced by its token; a
// retry can read it back with GetJob (JobRow.Progress). `worker status` shows it. It writes through its own
// connection and commits at once, beside a fenced transaction too; while another transaction
// writes the row it fails with ErrRowBusy after a short wait.
func (j *Job) SetProgress(ctx context.Context, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", j.claim.ID, err)
	}
	if err := j.lease.EnsureActive(); err != nil {
		return fmt.Errorf("set progress of job %d: %w: %w", j.claim.ID, ErrFenced, err)
	}
	if j.db == nil {
		return fmt.Errorf("set progress of job %d: %w: the job has no database (pooltest without one)", j.claim.ID, ErrFenced)
	}
	return j.rowError(store.SetProgress(ctx, j.db, j.claim.ID, j.claim.Token, b))
}

// SetProgressTx stores v as the job's checkpoint inside tx (for instance after Fence), fenced by
// its token: it is written by tx's commit, under the fence, or not at all.
func (j *Job) SetProgressTx(ctx context.Context, tx pgx.Tx, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", j.claim.ID, err)
	}
	if err := j.lease.EnsureActive(); err != nil {
		return fmt.Errorf("set progress of job %d: %w: %w", j.claim.ID, ErrFenced, err)
	}
	j.fenced.Store(true)
	return j.rowError(store.SetProgressTx(ctx, tx, j.claim.ID, j.claim.Token, b))
}

// Sleep waits for d, or returns early with context.Cause(ctx) when ctx ends.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// pickup is how long the job waited between becoming runnable and this attempt's start
// (database clock).
func (j *Job) pickup() time.Duration {
	from := j.claim.RunAt
	if from.Before(j.claim.CreatedAt) {
		from = j.claim.CreatedAt
	}
	return max(j.claim.AttemptedAt.Sub(from), 0)
}
