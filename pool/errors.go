package pool

import "errors"

// matchAlso returns err, made to match public too (errors.Is) when it matches internal: the
// store's sentinels stay internal, and callers match the package's own.
func matchAlso(err, internal, public error) error {
	if err == nil || !errors.Is(err, internal) {
		return err
	}
	return &alsoError{err: err, public: public}
}

// alsoError is err, matching public as well.
type alsoError struct{ err, public error }

func (e *alsoError) Error() string        { return e.err.Error() }
func (e *alsoError) Unwrap() error        { return e.err }
func (e *alsoError) Is(target error) bool { return target == e.public }

// ErrUnknownKind is matched (errors.Is) by the error of an attempt whose kind has no handler on
// the worker that claimed it. The attempt fails like any error and the job is retried with the
// usual backoff, so that in a rolling deploy a job of a new kind claimed by a worker of the
// previous version runs once a worker that knows the kind claims it; after its last attempt it
// fails, kept with that error, and leash.retry_job puts it back.
var ErrUnknownKind = errors.New("no handler registered for the job's kind")

// ErrStarted is returned by Register (and AddWorker) once Run has started: the set of kinds a
// worker runs is fixed before it claims its first job.
var ErrStarted = errors.New("pool: already running")

// ErrJobsCancelled is matched by Shutdown's error when its context ended before every running
// job finished, so that some were cancelled with lease.ErrShutdown and handed back (or, when a
// handler ignored the cancellation, left to their leases).
var ErrJobsCancelled = errors.New("running jobs cancelled at shutdown")
