-- leash 011: every function in schema leash resolves names with search_path = pg_catalog, pg_temp,
-- whoever calls it and whatever the caller's search_path. The trigger functions and the notify
-- helpers ran with the caller's: an inserting session whose search_path puts a schema others can
-- create in before pg_catalog (ALTER DATABASE ... SET search_path = public, pg_catalog) ran
-- whatever pg_notify(text, text) or now() was put there, inside every insert, revocation and
-- rescue. The functions that run with their owner's rights pinned it from the start.
-- Their bodies already name leash's objects with the schema (leash.waiters, leash.notify_revoked)
-- and PostgreSQL's without it (now(), pg_notify), which pg_catalog now resolves; the transition
-- table new_jobs is not looked up in a schema. Nothing else changes: no body, no signature.
-- Safe to apply while workers of the previous release run: ALTER FUNCTION ... SET only changes
-- the setting a call starts with, takes no lock on leash's tables and leaves the triggers as they
-- are; a statement running one of these functions at that moment finishes with the old setting.

ALTER FUNCTION leash.notify_available(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.notify_revoked(bigint, bigint, text, boolean) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.notify_job_available() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.revoke_queued() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.notify_job_revoked() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.notify_queue_changed() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION leash.schedule_changed() SET search_path = pg_catalog, pg_temp;
