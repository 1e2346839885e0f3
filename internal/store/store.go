// Package store holds every SQL statement leash runs against leash.jobs, one params struct per
// query, so that the SQL is in one place to read and review. It is internal: applications use
// package pool.
package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DBTX is what a query needs: a pool, a connection or a transaction.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner starts transactions.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Job states.
const (
	StatePending   = "pending"
	StateAvailable = "available"
	StateRunning   = "running"
	StateRetryable = "retryable"
	StateCompleted = "completed"
	StateFailed    = "failed"
	StateCancelled = "cancelled"
)

// millis is d in whole milliseconds, the unit every statement takes durations in, rounded up: a
// positive duration never becomes 0, which the statements read as none (no delay, no timeout, no
// window: UniqueFinishedWithin of 500µs turned the check off, Snooze(500µs) woke at once).
func millis(d time.Duration) int64 {
	ms := d / time.Millisecond
	if d%time.Millisecond > 0 {
		ms++
	}
	return int64(ms)
}
