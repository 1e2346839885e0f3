package store

import (
	"context"
	"fmt"
	"time"
)

// RegisterWaiter records that waiter waits for work on queues until ttl from now (database
// clock), so that inserts into those queues notify job_available (while the queue has room: see
// sql/014_privileges.sql), and removes its registrations for other queues. It also clears
// registrations that expired long ago (dead workers). Calling it again refreshes the
// registration.
func RegisterWaiter(ctx context.Context, db DBTX, waiter string, queues []string, ttl time.Duration) error {
	_, err := db.Exec(ctx, `
		WITH gone AS (
			DELETE FROM leash.waiters
			WHERE expires_at < now() - interval '10 minutes' OR (waiter = $1 AND queue <> ALL($2::text[]))
		)
		INSERT INTO leash.waiters (queue, waiter, expires_at)
		SELECT q, $1, now() + $3 * interval '1 millisecond' FROM unnest($2::text[]) AS q
		ON CONFLICT (queue, waiter) DO UPDATE SET expires_at = excluded.expires_at`,
		waiter, queues, millis(ttl))
	if err != nil {
		return fmt.Errorf("register as waiting for work: %w", err)
	}
	return nil
}

// UnregisterWaiter removes waiter's registrations: it is busy (or stopping) and needs no
// wake-up.
func UnregisterWaiter(ctx context.Context, db DBTX, waiter string) error {
	if _, err := db.Exec(ctx, `DELETE FROM leash.waiters WHERE waiter = $1`, waiter); err != nil {
		return fmt.Errorf("unregister as waiting for work: %w", err)
	}
	return nil
}
