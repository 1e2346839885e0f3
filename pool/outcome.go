package pool

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
)

// ErrTimeout is the cause a handler's context is cancelled with when its attempt runs past the
// job's timeout (the timeout column, or Config.Timeouts for its kind). The attempt then fails like
// an error: retried with backoff, or failed when its attempts are used up.
var ErrTimeout = errors.New("job timed out")

type timeoutError struct{ d time.Duration }

func (e *timeoutError) Error() string        { return fmt.Sprintf("job timed out after %s", e.d) }
func (e *timeoutError) Is(target error) bool { return target == ErrTimeout }

// revocation is the cause of a revocation that arrived as a notification; it matches
// lease.ErrRevoked and carries the notification's reason, which is recorded with the job.
type revocation struct {
	reason string
}

func (e *revocation) Error() string        { return "job revoked: " + e.reason }
func (e *revocation) Is(target error) bool { return target == lease.ErrRevoked }

// defaultRevokeReason is recorded for a revocation that arrived without a reason. It says how
// the job was revoked, not that it was: the stored error reads "job revoked: " and the reason.
const defaultRevokeReason = "by NOTIFY job_revoked"

// ending is how an attempt ended, as the worker saw it.
type ending struct {
	err         error // what the handler returned (a panic becomes *PanicError)
	cause       error // the lease's cause when the handler returned; nil if it still held
	attempt     int
	maxAttempts int
	backoff     func(attempt int) time.Duration
}

// decide maps an attempt's ending to the outcome to write, or write=false when nothing may be
// written (the lease was taken over: the fence would reject it anyway). It is the list in
// docs/guarantees.md ("What each ending writes"):
//
//   - the lease was lost to another worker: nothing;
//   - the job was revoked before the handler returned: cancelled, whatever it returned;
//   - the handler returned nil: completed;
//   - Snooze(d) while the lease holds: available after d, the attempt given back;
//   - shutdown cancelled it and it returned an error: available again, the attempt given back;
//   - Permanent, or attempts used up: failed;
//   - RetryAfter(d): retryable after d; timeout, renewal timeout, any other error or panic:
//     retryable after the backoff (renewal timeout: at once).
//
// The database adds the one rule the worker cannot know in time: a job revoked in its row
// before the write lands ends cancelled unless this outcome is completed.
func decide(id, token int64, worker string, e ending) (out store.Outcome, write bool) {
	out = store.Outcome{ID: id, Token: token}
	if errors.Is(e.cause, lease.ErrLost) {
		return out, false
	}
	var ae *store.AttemptError
	if e.err != nil {
		ae = &store.AttemptError{Attempt: int32(e.attempt), Error: e.err.Error(), Worker: worker}
		var pe *PanicError
		if errors.As(e.err, &pe) {
			ae.Stack = pe.Stack
		}
	}
	if errors.Is(e.cause, lease.ErrRevoked) {
		reason := "revoked"
		var rv *revocation
		var rr *leasekeeper.RevokedError
		if errors.As(e.cause, &rv) {
			reason = rv.reason
		} else if errors.As(e.cause, &rr) {
			reason = rr.Reason
		}
		out.State, out.Revoke = store.StateCancelled, &reason
		if ae == nil {
			ae = &store.AttemptError{Attempt: int32(e.attempt), Worker: worker,
				Error: e.cause.Error() + " (the handler returned success after the revocation reached it)"}
		} else {
			ae.Error = endedBy(e.cause, e.err)
		}
		out.Error = ae
		return out, true
	}
	if e.err == nil {
		out.State = store.StateCompleted
		return out, true
	}
	var sz *snoozeError
	if errors.As(e.err, &sz) && e.cause == nil {
		// A snooze is the handler's choice while its lease holds; one returned after a timeout
		// or at shutdown is treated as the error it then is (the attempt fails, or is handed
		// back at once).
		out.State, out.RunIn, out.ReturnAttempt = store.StateAvailable, sz.d, true
		return out, true
	}
	out.Error = ae
	var ra *retryAfterError
	switch {
	case errors.Is(e.cause, lease.ErrShutdown):
		out.State, out.Error, out.ReturnAttempt = store.StateAvailable, nil, true
		return out, true
	case errors.Is(e.cause, ErrTimeout):
		ae.Error = endedBy(e.cause, e.err)
		out.State, out.RunIn = store.StateRetryable, e.backoff(e.attempt)
	case errors.Is(e.cause, lease.ErrRenewalTimeout):
		// Still fenced: written only if nobody took the job meanwhile.
		ae.Error = endedBy(e.cause, e.err)
		out.State = store.StateRetryable
	case IsPermanent(e.err):
		out.State = store.StateFailed
	case errors.As(e.err, &ra):
		out.State, out.RunIn = store.StateRetryable, ra.d
	default:
		out.State, out.RunIn = store.StateRetryable, e.backoff(e.attempt)
	}
	if out.State == store.StateRetryable && e.attempt >= e.maxAttempts {
		out.State, out.RunIn = store.StateFailed, 0
	}
	return out, true
}

// endedBy is the stored error of an attempt that a lease cause ended and whose handler returned
// err: the cause, said once, then what the handler added. A handler that returns
// context.Cause(ctx), wraps it, or returns a bare context error adds nothing.
func endedBy(cause, err error) string {
	c, msg := cause.Error(), err.Error()
	switch {
	case strings.Contains(msg, c):
		return msg
	case msg == context.Canceled.Error() || msg == context.DeadlineExceeded.Error():
		return c
	}
	// The handler's error names the cause's kind already (a Fence that found the job revoked
	// says "job revoked"), but not its details: say the kind once, the details after it.
	for _, kind := range []error{lease.ErrRevoked, lease.ErrRenewalTimeout, ErrTimeout} {
		k := kind.Error()
		if rest, ok := strings.CutPrefix(c, k); ok && errors.Is(cause, kind) && strings.Contains(msg, k) {
			return msg + " (" + strings.TrimLeft(rest, ": ") + ")"
		}
	}
	return c + ": " + msg
}
