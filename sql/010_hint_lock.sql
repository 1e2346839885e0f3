-- leash 010: queue changes bind from their commit, and no role without grants can stall claims.
-- Claims now take their queue's row in leash.queues (FOR SHARE, or FOR UPDATE for a capped
-- queue; see the claim statements): a change to the row waits for the claims in flight, and the
-- claims after it read its new version. This migration adds what that needs on the table's side:
-- rows a worker creates for the queues it serves are marked, so that an operator's plain INSERT
-- of such a queue's row still works; a hint that makes new claims stand back while a change
-- waits for the row (share locks never queue behind a waiting writer, so a busy queue could
-- otherwise not be paused); a notification when the table is truncated. And the waiting hint is
-- serialized by a row lock only its owner can take, instead of an advisory lock that any role able
-- to connect could hold (pg_advisory_lock needs no grant): a stranger holding that key made every
-- registration wait a second and fail, and every idle worker fell back to polling.
-- Safe to apply while workers of the previous release run: 0.2.0 has no leash.queues, and its
-- workers register with the same statements and fire the same trigger on leash.waiters, whose
-- function changes here. The column is added with a constant default (a catalog change, no
-- rewrite); the triggers take a brief lock on leash.queues only.

-- A row a worker created for a queue it serves (what "no row" means: active, uncapped), rather
-- than one written by an operator. Such a row, while it still holds nothing else, gives way to an
-- operator's INSERT of the queue's row (below).
ALTER TABLE leash.queues ADD COLUMN IF NOT EXISTS implicit boolean NOT NULL DEFAULT false;

-- When a change to leash.queues began waiting for its rows, in milliseconds since the epoch; 0
-- while none waits. Claims of uncapped queues take no row while it is recent (half a second): a
-- FOR SHARE request is granted at once while others share the row, even when a writer waits, so
-- claims overlapping without a gap would hold off the change for ever. Set and cleared by the
-- triggers below, which run with their owner's rights; workers read it in their claims.
CREATE SEQUENCE IF NOT EXISTS leash.queue_change_hint AS bigint MINVALUE 0 START 0;

REVOKE ALL ON SEQUENCE leash.queue_change_hint FROM PUBLIC;

-- Marks that a change to leash.queues is about to wait for rows (BEFORE), and that it has them
-- (AFTER: the statement has locked and changed its rows; later claims skip those rows until it
-- commits). A statement that fails never clears the hint, which then runs out on its own. Of two
-- changes at once, the first to finish clears the other's hint too: the other has been waiting
-- behind fewer claims since, and claims after it only delay it by their own length.
CREATE OR REPLACE FUNCTION leash.queue_change_begins() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
        PERFORM setval('leash.queue_change_hint', greatest(1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint));
    ELSE
        PERFORM setval('leash.queue_change_hint', 0, true);
    END IF;
    RETURN NULL;
END;
$$;

REVOKE ALL ON FUNCTION leash.queue_change_begins() FROM PUBLIC;

DROP TRIGGER IF EXISTS queues_change_begins ON leash.queues;
CREATE TRIGGER queues_change_begins BEFORE UPDATE OR DELETE ON leash.queues
    FOR EACH STATEMENT EXECUTE FUNCTION leash.queue_change_begins();

DROP TRIGGER IF EXISTS queues_change_done ON leash.queues;
CREATE TRIGGER queues_change_done AFTER UPDATE OR DELETE ON leash.queues
    FOR EACH STATEMENT EXECUTE FUNCTION leash.queue_change_begins();

-- An INSERT of a queue's row by anyone but a worker (pause_queue, SetQueueMaxRunning, an
-- operator's plain INSERT) first removes the row a worker created for that queue, if it still
-- holds nothing else: the INSERT then takes effect as it would have on a table without that row,
-- and the DELETE waits for the claims holding the old row, as any change does. A worker's own
-- INSERT (implicit) never removes anything.
CREATE OR REPLACE FUNCTION leash.queue_replaces_implicit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT NEW.implicit AND EXISTS (
        SELECT FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL) THEN
        -- The DELETE's own statement triggers raise and clear the hint around its wait.
        DELETE FROM leash.queues q
        WHERE q.name OPERATOR(pg_catalog.=) NEW.name AND q.implicit
          AND q.paused_at IS NULL AND q.max_running IS NULL;
    END IF;
    RETURN NEW;
END;
$$;

REVOKE ALL ON FUNCTION leash.queue_replaces_implicit() FROM PUBLIC;

DROP TRIGGER IF EXISTS queues_replace_implicit ON leash.queues;
CREATE TRIGGER queues_replace_implicit BEFORE INSERT ON leash.queues
    FOR EACH ROW EXECUTE FUNCTION leash.queue_replaces_implicit();

-- TRUNCATE fires no row trigger: tell every worker to read the table again ('*': all queues), so
-- that they create their rows again at once rather than at their next poll.
CREATE OR REPLACE FUNCTION leash.notify_queues_truncated() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_notification_queue_usage() <= 0.5 THEN
        PERFORM pg_notify('queue_changed', '*');
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS queues_truncated ON leash.queues;
CREATE TRIGGER queues_truncated AFTER TRUNCATE ON leash.queues
    FOR EACH STATEMENT EXECUTE FUNCTION leash.notify_queues_truncated();

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
