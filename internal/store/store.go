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
	StateAvailable = "available"
	StateRunning   = "running"
	StateRetryable = "retryable"
	StateCompleted = "completed"
	StateFailed    = "failed"
	StateCancelled = "cancelled"
)

func millis(d time.Duration) int64 { return d.Milliseconds() }
