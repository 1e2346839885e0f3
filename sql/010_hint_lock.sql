-- leash 010: the waiting hint is serialized by a row lock that only its owner can take, instead of
-- an advisory lock that any role able to connect could hold (pg_advisory_lock needs no grant):
-- a stranger holding that key made every registration wait a second and fail, and every idle
-- worker fell back to polling. Claims no longer take an advisory lock either: a capped queue's
-- claims are serialized by the queue's row in leash.queues, which only roles allowed to UPDATE
-- that table can lock (see the claim statements).
-- Safe to apply while workers of the previous release run: they register with the same
-- statements and fire the same trigger, whose function changes here; they still take the old
-- advisory lock for their capped claims, which serializes them among themselves as before.

-- One row, locked by every change of the registrations for as long as it takes to set the hint.
-- Nobody but its owner may read, lock or change it.
CREATE TABLE IF NOT EXISTS leash.waiting_hint_lock (
    singleton boolean PRIMARY KEY DEFAULT true,
    CONSTRAINT waiting_hint_lock_singleton CHECK (singleton)
);

REVOKE ALL ON leash.waiting_hint_lock FROM PUBLIC;

INSERT INTO leash.waiting_hint_lock (singleton) VALUES (true) ON CONFLICT DO NOTHING;

-- As in 008, with the row lock in place of the advisory lock: of two workers changing their
-- registrations at once, the one that sets the hint last has seen the other's committed rows.
-- The lock is still waited for at most a second (a worker whose registration fails polls), but
-- only another registration, for the time a setval takes, can hold it now.
-- Under REPEATABLE READ the snapshot of the registering statement predates the lock; workers pin
-- READ COMMITTED on their own connections, where each statement here takes a fresh snapshot.
CREATE OR REPLACE FUNCTION leash.set_waiting_until() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    PERFORM FROM leash.waiting_hint_lock l WHERE l.singleton FOR UPDATE;
    PERFORM setval('leash.waiting_until', (
        SELECT greatest(0, least(9e18, coalesce(date_part('epoch', max(w.expires_at)) * 1000, 0)))::bigint
        FROM leash.waiters w));
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.set_waiting_until() FROM PUBLIC;
