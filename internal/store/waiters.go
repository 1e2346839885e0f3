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

// Wake is how a waiter of this release is woken (see sql/016_targeted_wakes.sql).
type Wake struct {
	// Channel is the channel only this waiter LISTENs on: "leash_wake_" and 16 lower-case hex
	// digits.
	Channel string
	// Slots is how many jobs the waiter could start now; an insert picks waiters until their
	// slots cover its rows.
	Slots int
	// Armed: the waiter may be picked (its listener is connected). A registration that is not
	// armed keeps the waiter out of the picks while it polls (a new one starts out as picked
	// long ago).
	Armed bool
}

// RegisterWaker is RegisterWaiter for a waiter that is woken on a channel of its own: inserts
// pick it (as wake says) rather than notify job_available. An armed registration also makes the
// waiter pickable again after a wake.
func RegisterWaker(ctx context.Context, db DBTX, waiter string, queues []string, ttl time.Duration, wake Wake) error {
	_, err := db.Exec(ctx, `
		WITH gone AS (
			DELETE FROM leash.waiters
			WHERE expires_at < now() - interval '10 minutes' OR (waiter = $1 AND queue <> ALL($2::text[]))
		)
		INSERT INTO leash.waiters AS w (queue, waiter, expires_at, wake_channel, slots, woken_at)
		SELECT q, $1, now() + $3 * interval '1 millisecond', $4, $5, CASE WHEN $6::boolean THEN NULL ELSE '-infinity'::timestamptz END
		FROM unnest($2::text[]) AS q
		ON CONFLICT (queue, waiter) DO UPDATE SET expires_at = excluded.expires_at,
			wake_channel = excluded.wake_channel, slots = excluded.slots,
			woken_at = CASE WHEN $6::boolean THEN NULL ELSE coalesce(w.woken_at, '-infinity') END`,
		waiter, queues, millis(ttl), wake.Channel, max(wake.Slots, 1), wake.Armed)
	if err != nil {
		return fmt.Errorf("register as waiting for work: %w", err)
	}
	return nil
}

// RearmWaiter makes a waiter that an insert picked pickable again, with slots free, without
// refreshing its registration: it changes only what the waiting hint does not depend on, so it
// costs no WAL and takes no lock beyond the waiter's own rows.
func RearmWaiter(ctx context.Context, db DBTX, waiter string, slots int) error {
	if _, err := db.Exec(ctx, `UPDATE leash.waiters SET woken_at = NULL, slots = $2
		WHERE waiter = $1 AND woken_at IS NOT NULL AND wake_channel IS NOT NULL`, waiter, max(slots, 1)); err != nil {
		return fmt.Errorf("wait for work again: %w", err)
	}
	return nil
}
