package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"
)

// Handler runs jobs of one kind. Handle returns nil when the job is done, an error to retry it
// (see Permanent and RetryAfter), and should return promptly with context.Cause(ctx) when ctx is
// cancelled: revoked, lease lost, renewal timed out or shutdown (see package lease).
type Handler interface {
	Handle(ctx context.Context, job *Job) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, job *Job) error

// Handle calls f(ctx, job).
func (f HandlerFunc) Handle(ctx context.Context, job *Job) error { return f(ctx, job) }

// Args adapts a function taking typed arguments to Handler. The payload is decoded into a T as
// encoding/json does: fields T does not have are ignored, so that a producer of a newer version
// may add a field before every worker knows it (a rolling deploy), and fields the payload lacks
// keep their zero value. A payload that is not one JSON value, or whose field has the wrong type,
// fails the job permanently with an error naming the kind and the field (retry_job puts it back
// once a fixed worker runs).
func Args[T any](fn func(ctx context.Context, job *Job, args T) error) Handler {
	t := reflect.TypeFor[T]()
	return HandlerFunc(func(ctx context.Context, job *Job) error {
		var args T
		// Unmarshal, unlike a Decoder, fails whatever follows the first value (a Decoder's More
		// passes a stray '}' or ']').
		if err := json.Unmarshal(job.Payload, &args); err != nil {
			return Permanent(fmt.Errorf("decode %s payload: %w", job.claim.Kind, describeDecodeError(err)))
		}
		if t.Kind() == reflect.Pointer && reflect.ValueOf(&args).Elem().IsNil() {
			// A payload of JSON null (a nil *T inserted, or SQL) sets the pointer to nil; fn is
			// promised a fresh T.
			args = reflect.New(t.Elem()).Interface().(T)
		}
		return fn(ctx, job, args)
	})
}

func describeDecodeError(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && te.Field != "" {
		return fmt.Errorf("field %q: expected %s, got JSON %s", te.Field, te.Type, te.Value)
	}
	return err
}

// Permanent marks err as not worth retrying: the job fails at once.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// RetryAfter retries the job after d instead of the configured backoff (still costing an attempt;
// the job fails when attempts are used up).
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		err = errors.New("retry requested")
	}
	return &retryAfterError{d: d, err: err}
}

// Snooze ends the attempt without using it up: the job becomes available again after d (the
// database clock), and its attempt number is given back, so a job may snooze any number of
// times. A revocation that reached the handler still wins (the job ends cancelled). A negative d
// counts as zero.
func Snooze(d time.Duration) error { return &snoozeError{d: max(d, 0)} }

type snoozeError struct{ d time.Duration }

func (e *snoozeError) Error() string { return fmt.Sprintf("snoozed for %s", e.d) }

type retryAfterError struct {
	d   time.Duration
	err error
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// PanicError is what a handler's panic becomes: recorded with its stack, retried like an error.
type PanicError struct {
	Value any
	Stack string
}

// Error describes the panic; the stack is in Stack.
func (e *PanicError) Error() string { return "handler panic: " + describe(e.Value) }

// Observer is told about each job as it finishes. Calls come from one goroutine of the pool's,
// in the order the events happened, after the outcome they report is written; a slow Observer
// delays only the events behind it (up to 65,536 are queued, then new ones are dropped and
// counted in Stats.EventsDropped), never claims, handlers or outcomes. Run delivers the last
// events before it returns, waiting at most Config.ShutdownTimeout for the Observer, and after
// Shutdown's context is done at most Config.ShutdownStallWait more; the events it then gives up
// on are dropped and counted, never delivered after Run returned. A panic in the Observer is
// logged and the event skipped.
type Observer interface {
	JobFinished(ev JobEvent)
}

// StartObserver is an optional extension of Observer, told as each attempt starts (State
// "running", Duration zero).
type StartObserver interface {
	JobStarted(ev JobEvent)
}

// JobEvent describes one attempt.
type JobEvent struct {
	Queue    string
	Kind     string
	State    string // completed, failed, retryable, cancelled, available (handed back), or "" when the lease was lost
	Duration time.Duration
	Pickup   time.Duration // from becoming runnable (created_at or run_at) to this attempt's start, database clock
	Stale    bool          // the outcome was rejected by the lease fence and not written
	// Err is what the handler returned (a panic as *PanicError); nil when it succeeded, and
	// always in JobStarted events and for an abandoned handler, which has not returned.
	Err error
	// Cause is why the attempt's lease ended before it was settled, nil if it held: one of the
	// causes in package lease (revoked, lost, renewal timeout, shutdown) or ErrTimeout. Match it
	// with errors.Is.
	Cause error
	// Abandoned: the handler ignored cancellation at shutdown and the pool stopped without it;
	// nothing was written and its lease is left to expire (State is "").
	Abandoned bool
}
