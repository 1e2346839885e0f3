package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// Per-key concurrency (migration 017). A job holds its key (leash.jobs.concurrency_key) from its
// first start until it is finished: while it runs and while, started, it waits to run again
// (attempted_at is set). A queue with max_running_per_key is claimed by ClaimKeyed alone, under
// the queue's row as a capped queue is, so that the claims of the queue run one at a time across
// all workers and each counts the holders of its keys in a snapshot that sees every claim before
// it: never more than max_running_per_key holders of one key. leash.concurrency_keys lists the
// keys that have a job to claim, at that job's position, and the claim walks it in order, so it
// never walks the jobs of a key at its limit.

// keyHoldersSQL is true for a job (alias %[1]s) that holds its key; jobs_key_holders_idx has
// exactly this predicate.
const keyHoldersSQL = `%[1]s.concurrency_key IS NOT NULL
	AND (%[1]s.state = 'running' OR (%[1]s.state IN ('available', 'retryable') AND %[1]s.attempted_at IS NOT NULL))`

// keyRefreshSQL brings the rows of leash.concurrency_keys of the keys listed by the CTE targets
// (%s, a list of key) of queue $1 up to date, in one statement and so in one snapshot: a key with
// something to claim gets its row at the position of that, any other loses its row. What to claim
// is, first, a job that holds the key and waits to run again, and, while fewer than the limit hold
// the key, its first job not yet started; due ones first, else the earliest to come due. It runs
// only in a claim holding the queue's row ($2, the claim's mark, as in lockQueueRowSQL).
var keyRefreshSQL = `
	WITH lim AS (
		SELECT q.max_running_per_key AS n FROM leash.queues q
		WHERE q.name = $1 AND q.max_running_per_key IS NOT NULL
		  AND pg_catalog.current_setting('leash.capped_claim', true) = $2::text
	), %s, calc AS (
		SELECT t.key, hc.holders, best.priority, best.run_at, best.id
		FROM targets t CROSS JOIN lim
		CROSS JOIN LATERAL (
			SELECT count(*) AS holders FROM leash.jobs h
			WHERE h.queue = $1 AND h.concurrency_key = t.key AND ` + fmt.Sprintf(keyHoldersSQL, "h") + `) hc
		LEFT JOIN LATERAL (
			SELECT s.priority, s.run_at, s.id FROM leash.jobs s
			WHERE s.queue = $1 AND s.concurrency_key = t.key AND ` + fmt.Sprintf(keyHoldersSQL, "s") + `
			  AND s.state IN ('available', 'retryable') AND s.attempted_at IS NOT NULL AND s.revoked_at IS NULL
			ORDER BY s.run_at > now(), CASE WHEN s.run_at > now() THEN s.run_at END, s.priority, s.run_at, s.id
			LIMIT 1) st ON true
		LEFT JOIN LATERAL (
			SELECT f.priority, f.run_at, f.id FROM leash.jobs f
			WHERE f.queue = $1 AND f.concurrency_key = t.key AND f.concurrency_key IS NOT NULL
			  AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL AND f.revoked_at IS NULL
			  AND f.run_at <= now() AND hc.holders < lim.n
			ORDER BY f.priority, f.run_at, f.id
			LIMIT 1) fd ON true
		LEFT JOIN LATERAL (
			SELECT f.priority, f.run_at, f.id FROM leash.jobs f
			WHERE f.queue = $1 AND f.concurrency_key = t.key AND f.concurrency_key IS NOT NULL
			  AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL AND f.revoked_at IS NULL
			  AND f.run_at > now() AND hc.holders < lim.n AND fd.id IS NULL
			ORDER BY f.run_at, f.priority, f.id
			LIMIT 1) fl ON true
		LEFT JOIN LATERAL (
			SELECT c.priority, c.run_at, c.id
			FROM (VALUES (st.priority, st.run_at, st.id), (fd.priority, fd.run_at, fd.id), (fl.priority, fl.run_at, fl.id))
			     AS c(priority, run_at, id)
			WHERE c.id IS NOT NULL
			ORDER BY c.run_at > now(), CASE WHEN c.run_at > now() THEN c.run_at END, c.priority, c.run_at, c.id
			LIMIT 1) best ON true
	), kept AS (
		INSERT INTO leash.concurrency_keys AS c (queue, key, next_priority, next_run_at, next_id)
		SELECT $1, calc.key, calc.priority, calc.run_at, calc.id FROM calc WHERE calc.id IS NOT NULL
		ON CONFLICT (queue, key) DO UPDATE
			SET next_priority = excluded.next_priority, next_run_at = excluded.next_run_at, next_id = excluded.next_id
			WHERE (c.next_priority, c.next_run_at, c.next_id) IS DISTINCT FROM (excluded.next_priority, excluded.next_run_at, excluded.next_id)
		RETURNING 1
	), dropped AS (
		DELETE FROM leash.concurrency_keys c USING calc
		WHERE c.queue = $1 AND c.key = calc.key AND calc.id IS NULL
		RETURNING 1
	)
	SELECT (SELECT count(*) FROM calc), (SELECT count(*) FROM kept), (SELECT count(*) FROM dropped)`

// maxWakesPerClaim bounds the keys one claim brings up to date from leash.key_wakes; the rest
// wait for the next claim of the queue.
const maxWakesPerClaim = 1000

// keyWakesSQL brings up to date the keys of queue $1 that leash.key_wakes lists (at most $3 of
// them), and deletes their entries in the same statement: an entry appended by a transaction this
// statement's snapshot does not see stays for the next claim, and every change an entry it
// deletes stands for is in that snapshot.
var keyWakesSQL = fmt.Sprintf(keyRefreshSQL, `targets AS (
		SELECT DISTINCT w.key FROM (
			-- In the index's order: an index scan passes over the entries of wakes already
			-- deleted (a burst's thousands, until vacuum) at the cost of an index entry each,
			-- where a bitmap scan would read their rows. '' (jobs without a key) sorts first.
			SELECT k.key FROM leash.key_wakes k WHERE k.queue = $1 AND k.key > '' ORDER BY k.key LIMIT $3) w
		WHERE EXISTS (SELECT FROM lim)
	), woken AS (
		DELETE FROM leash.key_wakes w
		WHERE w.queue = $1 AND w.key = ANY (ARRAY(SELECT t.key FROM targets t))
		RETURNING 1
	)`)

// keyWalkSQL is the claim's walk of the keys with something to claim now, in the order of what
// they have (the CTE keys; %[1]s: a condition, %[2]s: the parameter of how many keys at most): claimKeyedSQL takes from these
// keys, and keyWalkedSQL, after it in the same transaction, brings the same keys up to date (no
// other transaction writes the queue's rows while the claim holds the queue's row, and now() is
// the transaction's, so the walk finds the same keys).
const keyWalkSQL = `keys AS (
		SELECT c.key FROM leash.concurrency_keys c
		WHERE c.queue = $1 AND c.next_run_at <= now() AND %[1]s
		ORDER BY c.next_priority, c.next_run_at, c.next_id, c.key
		LIMIT %[2]s
	)`

var keyWalkedSQL = fmt.Sprintf(keyRefreshSQL, fmt.Sprintf(`%s, targets AS (SELECT key FROM keys)`,
	fmt.Sprintf(keyWalkSQL, `EXISTS (SELECT FROM lim)`, `$3::int`)))

// claimKeyedSQL claims from a queue with a per-key limit, after lockQueueRowSQL (mark $5) in
// the same READ COMMITTED transaction: for each key of the walk, the jobs that hold it and are due
// (all of them: they hold the key already, and are few),
// then, while fewer than the limit hold it, its first jobs not yet started; with $6, or when such
// jobs were inserted or queued again since the last claim (an entry of key ”), the queue's jobs
// without a key as well; all in claim order, at most $2, and no more than the queue's own
// cap leaves room for. The holders are counted in this statement's snapshot, taken after the
// queue's row was granted: it sees every claim of the queue committed before, and no other is in
// flight.
var claimKeyedSQL = fmt.Sprintf(`
	WITH room AS (
		SELECT CASE WHEN q.paused_at IS NOT NULL OR q.max_running_per_key IS NULL THEN 0
		            WHEN q.max_running IS NULL THEN $2::int
		            ELSE greatest(0, least($2::int, q.max_running - (
		                SELECT count(*) FROM leash.jobs r WHERE r.queue = $1 AND r.state = 'running')::int))
		       END AS n,
		       q.max_running_per_key AS per_key
		FROM leash.queues q
		WHERE q.name = $1 AND pg_catalog.current_setting('leash.capped_claim', true) = $5::text
	), `+fmt.Sprintf(keyWalkSQL, `EXISTS (SELECT FROM room WHERE room.per_key IS NOT NULL)`, `$2::int`)+`, unkeyed_woken AS (
		-- Jobs without a key were inserted or queued again since the last claim that looked.
		DELETE FROM leash.key_wakes w
		WHERE w.queue = $1 AND w.key = '' AND EXISTS (SELECT FROM room WHERE room.per_key IS NOT NULL)
		RETURNING 1
	), cand AS (
		SELECT s.id, s.ctid, s.priority, s.run_at
		FROM keys k CROSS JOIN room
		CROSS JOIN LATERAL (
			SELECT count(*) AS holders FROM leash.jobs h
			WHERE h.queue = $1 AND h.concurrency_key = k.key AND `+fmt.Sprintf(keyHoldersSQL, "h")+`) hc
		CROSS JOIN LATERAL (
			(SELECT a.id, a.ctid, a.priority, a.run_at FROM leash.jobs a
			 WHERE a.queue = $1 AND a.concurrency_key = k.key AND `+fmt.Sprintf(keyHoldersSQL, "a")+`
			   AND a.state IN ('available', 'retryable') AND a.attempted_at IS NOT NULL
			   AND a.run_at <= now() AND a.revoked_at IS NULL)
			UNION ALL
			(SELECT f.id, f.ctid, f.priority, f.run_at FROM leash.jobs f
			 WHERE f.queue = $1 AND f.concurrency_key = k.key AND f.concurrency_key IS NOT NULL
			   AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL
			   AND f.run_at <= now() AND f.revoked_at IS NULL
			 ORDER BY f.priority, f.run_at, f.id
			 LIMIT greatest(room.per_key - hc.holders, 0))) s
		UNION ALL
		(SELECT u.id, u.ctid, u.priority, u.run_at FROM leash.jobs u
		 WHERE ($6::boolean OR EXISTS (SELECT FROM unkeyed_woken)) AND u.queue = $1 AND u.state IN ('available', 'retryable') AND u.concurrency_key IS NULL
		   AND u.run_at <= now() AND u.revoked_at IS NULL AND EXISTS (SELECT FROM room WHERE room.n > 0)
		 ORDER BY u.priority, u.run_at, u.id
		 LIMIT $2)
	), chosen AS (
		SELECT ctid FROM cand ORDER BY priority, run_at, id LIMIT (SELECT coalesce(min(n), 0) FROM room)
	), picked AS (
		-- Locked once chosen, so that a job locked by another transaction is passed over, never
		-- the one after it taken in its place (a key's order holds); a row changed since this
		-- statement's snapshot has another ctid and is passed over too. By its ctid alone: any
		-- other condition lets a plan made without statistics scan the claim index for it.
		SELECT j.id, j.ctid FROM leash.jobs j
		WHERE j.ctid = ANY (ARRAY(SELECT ctid FROM chosen))
		FOR UPDATE OF j SKIP LOCKED
	)`+claimTail, claimTraceContextBytes)

// KeyedParams are ClaimParams for ClaimKeyed, and whether to look for the queue's jobs without a
// key too whether or not some were inserted or queued again since the last claim that looked
// (their walk passes over the queue's keyed jobs, so it is made only when there is reason to
// expect some: see pool's claim).
type KeyedParams struct {
	ClaimParams
	Unkeyed bool
}

// ClaimKeyed leases up to p.Limit runnable jobs of p.Queues[0], a queue with a per-key limit
// (max_running_per_key): never so many that more than that many jobs of one key hold it across
// all workers, nor more than the queue's max_running run; none while it is paused. One READ
// COMMITTED transaction, in one round trip: the queue's row, then the keys woken since the last
// claim, the claim, and the walked keys brought up to date. It returns ErrQueueBusy, having
// claimed nothing, when the queue's row is held.
func ClaimKeyed(ctx context.Context, db Batcher, p KeyedParams) ([]ClaimedJob, error) {
	if len(p.Queues) != 1 {
		return nil, fmt.Errorf("claim jobs of a queue with a per-key limit: want one queue, got %d", len(p.Queues))
	}
	q := p.Queues[0]
	b := &pgx.Batch{}
	b.Queue(`BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE`)
	mark := strconv.FormatUint(rand.Uint64(), 36)
	b.Queue(lockQueueRowSQL, q, mark)
	b.Queue(keyWakesSQL, q, mark, maxWakesPerClaim)
	b.Queue(claimKeyedSQL, q, p.Limit, p.WorkerID, millis(p.Lease), mark, p.Unkeyed)
	b.Queue(keyWalkedSQL, q, mark, p.Limit)
	b.Queue(`COMMIT`)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: begin: %w", q, err)
	}
	tag, err := br.Exec()
	if err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: lock the queue's row: %w", q, err)
	}
	locked := tag.RowsAffected() > 0
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: bring woken keys up to date: %w", q, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	jobs, err := scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: bring walked keys up to date: %w", q, err)
	}
	if _, err := br.Exec(); err != nil {
		// Nothing committed: the rows the claim leased are available again.
		return nil, fmt.Errorf("claim jobs of queue %q: commit: %w", q, err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	if !locked && len(jobs) == 0 {
		return nil, fmt.Errorf("claim jobs of queue %q: %w", q, ErrQueueBusy)
	}
	return jobs, nil
}

// SetQueueMaxRunningPerKey sets the queue's per-key limit (leash.set_queue_max_running_per_key);
// nil removes it.
func SetQueueMaxRunningPerKey(ctx context.Context, db DBTX, name string, max *int) error {
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.set_queue_max_running_per_key($1, $2)`, name, max).Scan(&changed); err != nil {
		return fmt.Errorf("set max_running_per_key of queue %q: %w", name, err)
	}
	return nil
}
