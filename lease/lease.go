// Package lease is the lease as a handler sees it: the causes a job's context is cancelled with
// when its lease ends. Every running job is on a lease, renewed by its worker; when the lease
// ends, the job's context is cancelled and context.Cause(ctx) tells why:
//
//	if errors.Is(context.Cause(ctx), lease.ErrRevoked) { ... }
//
// Before a side effect outside the database, a handler calls pool.Job.EnsureActive; for effects
// in the same database, pool.Job.Fence and pool.Job.CompleteTx. Renewing, ending and rescuing
// leases is the pool's business alone: no handler can end or renew a lease.
package lease

import "errors"

// Causes a job's context is cancelled with; match them with errors.Is(context.Cause(ctx), ...).
var (
	// ErrRevoked: an operator revoked the job (leash.revoke_job, NOTIFY job_revoked, or an
	// UPDATE of revoked_at).
	ErrRevoked = errors.New("job revoked")
	// ErrLost: the lease is gone: another worker took the job over, or the row no longer holds
	// this lease's token.
	ErrLost = errors.New("job lease lost")
	// ErrRenewalTimeout: no renewal was confirmed within the trust window (database unreachable
	// or process stalled); the worker stops before anyone else may take the job.
	ErrRenewalTimeout = errors.New("job lease renewal timed out")
	// ErrShutdown: the worker is shutting down and the grace period ran out.
	ErrShutdown = errors.New("worker shutting down")
)
