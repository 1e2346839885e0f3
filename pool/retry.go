package pool

import (
	"context"

	"github.com/leashq/leash/internal/store"
)

// RetryJob makes a failed or cancelled job run once more: it becomes available at once with one
// more attempt allowed (max_attempts is raised if it was used up), its revocation, if any, is
// lifted, and its error history is kept. It reports false for an unknown job or one that is
// queued or running. When another unfinished job holds the job's unique key it fails (a unique
// violation naming the key) and changes nothing.
func RetryJob(ctx context.Context, db DB, id int64) (bool, error) {
	return store.RetryJob(ctx, db, id)
}
