package pool

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/internal/testwork"
)

func init() { testwork.Work = work }

// testWorker is the leased_by of attempts package pooltest runs.
const testWorker = "pooltest"

// work runs h on one attempt of a job of kind outside any Pool, for package pooltest, and
// returns the attempt, what h returned and the job's state afterwards. With db, the job is
// inserted and claimed (a real row and lease token, so Fence, CompleteTx and SetProgress work),
// its lease renewed while h runs, and the attempt's outcome written fenced as a Pool writes it;
// the state is the row's. Without db, nothing is stored: the lease holds for LeaseDurationDefault
// minus the safety margin, fenced writes fail, and the state is the outcome a Pool would write.
func work(ctx context.Context, db DB, kind string, payload any, opts *InsertOpts, h Handler) (job *Job, state string, handlerErr, err error) {
	if h == nil {
		return nil, "", nil, errors.New("pooltest: no handler")
	}
	var cj store.ClaimedJob
	sentAt := time.Now()
	if db != nil {
		id, err := Insert(ctx, db, kind, payload, opts)
		if err != nil {
			return nil, "", nil, fmt.Errorf("pooltest: %w", err)
		}
		sentAt = time.Now()
		if cj, err = store.ClaimByID(ctx, db, id, testWorker, LeaseDurationDefault); err != nil {
			return nil, "", nil, fmt.Errorf("pooltest: %w", err)
		}
	} else {
		p, err := params(kind, payload, opts)
		if err != nil {
			return nil, "", nil, fmt.Errorf("pooltest: %w", err)
		}
		now := time.Now()
		cj = store.ClaimedJob{Queue: p.Queue, Kind: p.Kind, Payload: p.Payload, Priority: p.Priority, Attempt: 1,
			MaxAttempts: p.MaxAttempts, CreatedAt: now, RunAt: now, AttemptedAt: now, TraceContext: p.TraceContext}
		if len(cj.Payload) == 0 {
			cj.Payload = []byte("{}")
		}
		if cj.Queue == "" {
			cj.Queue = QueueDefault
		}
		if cj.MaxAttempts == 0 {
			cj.MaxAttempts = MaxAttemptsDefault
		}
	}

	j := newJob(cj, db)
	l := j.lease
	keeper := leasekeeper.NewKeeper(db, leasekeeper.Config{}, func() []*leasekeeper.Lease { return []*leasekeeper.Lease{l} }, nil, nil)
	jctx := keeper.HoldIn(l, ctx, cj.ID, cj.Token, sentAt)
	if db != nil {
		kctx, stop := context.WithCancel(context.WithoutCancel(ctx))
		done := make(chan struct{})
		go func() { defer close(done); keeper.Run(kctx) }()
		defer func() { stop(); <-done }()
	}
	if cj.Timeout > 0 {
		t := time.AfterFunc(cj.Timeout, func() { l.End(&timeoutError{cj.Timeout}) })
		defer t.Stop()
	}

	herr := stable(callForTest(jctx, h, j))
	l.MarkFinishing()
	defer keeper.Release(l)
	out, write := decide(j.claim.ID, j.claim.Token, testWorker, ending{err: herr, cause: l.Cause(), attempt: int(j.claim.Attempt),
		maxAttempts: int(j.claim.MaxAttempts), backoff: DefaultRetryBackoff})
	out.Output = j.recordedOutput()
	if db == nil {
		if !write {
			return j, "", herr, nil
		}
		return j, out.State, herr, nil
	}
	if write && !(out.State == store.StateCompleted && j.doneInTx.Load()) {
		if _, err = store.Finish(context.WithoutCancel(ctx), db, []store.Outcome{out}); err != nil {
			return j, "", herr, fmt.Errorf("pooltest: write the outcome of job %d: %w", j.claim.ID, err)
		}
	}
	row, err := GetJob(context.WithoutCancel(ctx), db, j.claim.ID)
	if err != nil {
		return j, "", herr, fmt.Errorf("pooltest: %w", err)
	}
	return j, row.State, herr, nil
}

// callForTest runs h as a Pool does, a panic becoming a *PanicError.
func callForTest(ctx context.Context, h Handler, j *Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
		}
	}()
	err = h.Handle(ctx, j)
	j.err = err
	return err
}
