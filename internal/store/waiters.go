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
	if _, err := db.Exec(ctx, `
		WITH bounded AS (SELECT pg_catalog.set_config('lock_timeout', '`+waitersLockTimeout+`', true) AS v)
		DELETE FROM leash.waiters WHERE waiter = $1 AND (SELECT v FROM bounded) IS NOT NULL`, waiter); err != nil {
		return fmt.Errorf("unregister as waiting for work: %w", err)
	}
	return nil
}

// waitersLockTimeout bounds how long a statement on a waiter's own rows waits for a lock on
// them: an insert's trigger holds a waiter's row from its pick to its commit, a vacuum truncating
// the table holds it for a moment, and a forgotten transaction may hold any row. The claim loop waits for these statements; past the bound they
// fail (SQLSTATE 55P03) and the worker polls instead until the next try.
const waitersLockTimeout = "500ms"

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
	// Poll: the registration is refreshed at the waiter's poll, which claims unless another
	// waiter of each of its queues claimed for its own poll within PollWindow (see
	// sql/019_wake_races.sql); RegisterWaker reports which, and records the poll if it claims.
	// A PollWindow of 0 always claims.
	Poll       bool
	PollWindow time.Duration
}

// RegisterWaker is RegisterWaiter for a waiter that is woken on a channel of its own: inserts
// pick it (as wake says) rather than notify job_available. An armed registration also makes the
// waiter pickable again after a wake. claim reports whether the waiter's poll should claim (true
// unless wake.Poll and its queues are covered by other waiters' polls; see Wake.Poll). Only live
// registrations with a poll time no later than now cover a queue: a row written with a poll in
// the future covers nothing.
func RegisterWaker(ctx context.Context, db DBTX, waiter string, queues []string, ttl time.Duration, wake Wake) (claim bool, err error) {
	err = db.QueryRow(ctx, `
		WITH bounded AS (SELECT pg_catalog.set_config('lock_timeout', '`+waitersLockTimeout+`', true) AS v),
		gone AS (
			DELETE FROM leash.waiters
			WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM leash.waiters, bounded
				WHERE expires_at < now() - interval '10 minutes' OR (waiter = $1 AND queue <> ALL($2::text[]))
				FOR UPDATE OF waiters SKIP LOCKED))
		), cover AS (
			SELECT $8::bigint > 0 AND coalesce(bool_and(EXISTS (
				SELECT FROM leash.waiters o
				WHERE o.queue = q AND o.waiter <> $1 AND o.expires_at > now()
				  AND o.polled_at > now() - $8 * interval '1 millisecond' AND o.polled_at <= now())), false) AS covered
			FROM unnest($2::text[]) AS q
		), reg AS (
			INSERT INTO leash.waiters AS w (queue, waiter, expires_at, wake_channel, slots, woken_at, polled_at)
			SELECT q, $1, now() + $3 * interval '1 millisecond', $4, $5,
				CASE WHEN $6::boolean THEN NULL ELSE '-infinity'::timestamptz END,
				CASE WHEN $7::boolean AND NOT (SELECT covered FROM cover) THEN now() END
			FROM unnest($2::text[]) AS q, bounded
			ON CONFLICT (queue, waiter) DO UPDATE SET expires_at = excluded.expires_at,
				wake_channel = excluded.wake_channel, slots = excluded.slots,
				woken_at = CASE WHEN $6::boolean THEN NULL ELSE coalesce(w.woken_at, '-infinity') END,
				polled_at = coalesce(excluded.polled_at, w.polled_at)
		)
		SELECT NOT covered FROM cover`,
		waiter, queues, millis(ttl), wake.Channel, max(wake.Slots, 1), wake.Armed, wake.Poll, millis(wake.PollWindow)).Scan(&claim)
	if err != nil {
		return true, fmt.Errorf("register as waiting for work: %w", err)
	}
	return claim, nil
}

// RearmWaiter makes a waiter that an insert picked pickable again, with slots free, without
// refreshing its registration: it changes only what the waiting hint does not depend on, so it
// costs no WAL and takes no lock beyond the waiter's own rows.
func RearmWaiter(ctx context.Context, db DBTX, waiter string, slots int) error {
	if _, err := db.Exec(ctx, `
		WITH bounded AS (SELECT pg_catalog.set_config('lock_timeout', '`+waitersLockTimeout+`', true) AS v)
		UPDATE leash.waiters SET woken_at = NULL, slots = $2
		WHERE waiter = $1 AND woken_at IS NOT NULL AND wake_channel IS NOT NULL AND (SELECT v FROM bounded) IS NOT NULL`,
		waiter, max(slots, 1)); err != nil {
		return fmt.Errorf("wait for work again: %w", err)
	}
	return nil
}
