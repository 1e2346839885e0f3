package pool

import (
	"context"
	"log/slog"
	"sync"
)

// attemptKey is the context key of a running attempt's attemptInfo.
type attemptKey struct{}

// attemptCtx is a handler's context: its lease's, carrying the attempt's attemptInfo under
// attemptKey, as context.WithValue's would, in the job's own allocation.
type attemptCtx struct {
	context.Context
	info *attemptInfo
}

// Value implements context.Context.
func (c *attemptCtx) Value(key any) any {
	if key == (attemptKey{}) {
		return c.info
	}
	return c.Context.Value(key)
}

// attemptInfo is what a handler's context carries about its attempt.
type attemptInfo struct {
	job  *Job
	base *slog.Logger

	once sync.Once
	log  *slog.Logger
}

// Logger returns the logger for code running under ctx. In a handler's context (the ctx its
// Handle gets, or any context derived from it) it is the pool's logger (Config.Logger, with the
// worker's id) with the attempt attached as typed attributes: job_id and lease_token (int64),
// kind and queue (string), attempt (int). Any other context gets slog.Default(), so code shared
// between handlers and the rest of an application can log through Logger unconditionally.
func Logger(ctx context.Context) *slog.Logger {
	a, ok := ctx.Value(attemptKey{}).(*attemptInfo)
	if !ok {
		return slog.Default()
	}
	a.once.Do(func() {
		j := a.job
		a.log = a.base.With(slog.Int64("job_id", j.claim.ID), slog.String("kind", j.claim.Kind), slog.String("queue", j.claim.Queue),
			slog.Int("attempt", int(j.claim.Attempt)), slog.Int64("lease_token", j.claim.Token))
	})
	return a.log
}
