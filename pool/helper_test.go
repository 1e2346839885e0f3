package pool_test

import (
	"context"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/pool"
)

// runHelperWorker runs this test binary as a worker process when LEASH_HELPER_DB is set, for
// tests that need a real process to crash. It reports whether it ran.
func runHelperWorker() bool {
	url := os.Getenv("LEASH_HELPER_DB")
	if url == "" {
		return false
	}
	ctx := context.Background()
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		os.Exit(2)
	}
	p, err := pool.New(db, pool.Config{
		ID: "helper-" + os.Getenv("LEASH_HELPER_ID"), Queues: strings.Split(os.Getenv("LEASH_HELPER_QUEUES"), ","),
		LeaseDuration: time.Second, HeartbeatInterval: 200 * time.Millisecond, RescueInterval: 100 * time.Millisecond,
		PollInterval: 50 * time.Millisecond,
	})
	if err != nil {
		os.Exit(2)
	}
	p.Register("crash", pool.HandlerFunc(func(context.Context, *pool.Job) error {
		os.Exit(3) // a job that kills its worker process
		return nil
	}))
	p.Run(ctx)
	os.Exit(0)
	return true
}

// ensureAndClaim creates the queues' rows, as a pool does before it claims, then claims.
func ensureAndClaim(ctx context.Context, db store.DBTX, p store.ClaimParams) ([]store.ClaimedJob, error) {
	if err := store.EnsureQueues(ctx, db, p.Queues); err != nil {
		return nil, err
	}
	return store.Claim(ctx, db.(store.Batcher), p) // a pool, a connection or a transaction
}
