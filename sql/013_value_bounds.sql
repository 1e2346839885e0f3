-- leash 013: a queued job's attempt counter always has room for one more claim, so that no row a
-- client writes can make a claim fail for the other rows. A claim counts attempt + 1: a queued
-- row whose attempt was already the largest integer made the whole claim statement fail
-- ("integer out of range"), and with it every claim of its queue, and of every worker that
-- serves that queue with others. The table now refuses such a row; rows written before this
-- migration are set aside by the claim instead of leased (failed, with an error naming why).
-- Every other write keeps the rule by itself: a job whose counter reached the largest integer has
-- used up any max_attempts, so its attempt ends it failed or cancelled, never queued, and a
-- hand-back or a snooze gives the attempt back.
-- Checked for new and updated rows only (NOT VALID): adding it scans nothing and takes only a
-- brief lock. A NOT VALID check still applies to every later UPDATE of an old row, which is why
-- it binds queued rows alone: an old running or finished row at the limit stays writable (renewed,
-- finished, rescued), and the claim's set-aside write (failed) satisfies it.
-- Safe to apply while workers of the previous release run: their claims, outcomes, renewals and
-- rescues never write a queued row at the limit.
ALTER TABLE leash.jobs ADD CONSTRAINT jobs_attempt_room_check
    CHECK (attempt < 2147483647 OR state NOT IN ('available', 'retryable')) NOT VALID;
