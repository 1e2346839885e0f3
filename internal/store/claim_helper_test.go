package store_test

import (
	"context"

	"github.com/leashq/leash/internal/store"
)

// ensureAndClaim creates the queues' rows, as a pool does before it claims, then claims.
func ensureAndClaim(ctx context.Context, db store.DBTX, p store.ClaimParams) ([]store.ClaimedJob, error) {
	if err := store.EnsureQueues(ctx, db, p.Queues); err != nil {
		return nil, err
	}
	return store.Claim(ctx, db.(store.Batcher), p) // a pool, a connection or a transaction
}

// ensureAndFinishAndClaim is store.FinishAndClaim after creating the queues' rows.
func ensureAndFinishAndClaim(ctx context.Context, db interface {
	store.DBTX
	store.Batcher
}, outs []store.Outcome, p store.ClaimParams) ([]store.Written, []store.ClaimedJob, error) {
	if err := store.EnsureQueues(ctx, db, p.Queues); err != nil {
		return nil, nil, err
	}
	return store.FinishAndClaim(ctx, db, outs, p)
}
