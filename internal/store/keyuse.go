package store

import (
	"context"
	"fmt"
	"time"
)

// KeyUse is one concurrency key of a queue: how many jobs hold it and how many wait to start.
type KeyUse struct {
	Key string
	// Holders counts the jobs holding the key: running, or started and waiting to run again.
	Holders int64
	// Waiting counts the key's jobs not yet started that are due now.
	Waiting int64
	// OutOfRate: the key has no room under its queue's per-key rate limit; RateWait is how long
	// until it has (0 with a limit of 0, or a start recorded more than a year ahead: not in sight).
	OutOfRate bool
	RateWait  time.Duration
}

// keyUseSQL reads the use of a bounded set of keys of queue $1: the first $2 keys, in key order,
// that jobs hold (a skip scan of jobs_key_holders_idx, one descent per key), the first $2 keys
// that have jobs not yet started (the same on jobs_key_queued_idx), and the first $2 keys of
// leash.concurrency_keys in the order the claims walk them (the keys next in line, on its index).
// Each key's holders and due jobs not yet started are counted up to $3 on the key's range of
// jobs_key_holders_idx and jobs_key_queued_idx (migration 025), and under a per-key rate limit,
// how long until the key has room (its row of leash.key_rates, migration 029). It reads neither
// the queue's other jobs nor its keys beyond these: at most 3×$2 keys and 6×$2×$3 index entries.
const keyUseSQL = `
	WITH RECURSIVE held(key, i) AS (
		SELECT (SELECT min(h.concurrency_key) FROM leash.jobs h
		        WHERE h.queue = $1 AND h.concurrency_key IS NOT NULL
		          AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))), 1
		UNION ALL
		SELECT (SELECT min(h.concurrency_key) FROM leash.jobs h
		        WHERE h.queue = $1 AND h.concurrency_key > held.key AND h.concurrency_key IS NOT NULL
		          AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))), held.i + 1
		FROM held WHERE held.key IS NOT NULL AND held.i < $2
	), queued(key, i) AS (
		SELECT (SELECT min(f.concurrency_key) FROM leash.jobs f
		        WHERE f.queue = $1 AND f.concurrency_key IS NOT NULL
		          AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL), 1
		UNION ALL
		SELECT (SELECT min(f.concurrency_key) FROM leash.jobs f
		        WHERE f.queue = $1 AND f.concurrency_key > queued.key AND f.concurrency_key IS NOT NULL
		          AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL), queued.i + 1
		FROM queued WHERE queued.key IS NOT NULL AND queued.i < $2
	), keys AS (
		SELECT held.key FROM held WHERE held.key IS NOT NULL
		UNION
		SELECT queued.key FROM queued WHERE queued.key IS NOT NULL
		UNION
		(SELECT c.key FROM leash.concurrency_keys c WHERE c.queue = $1
		 ORDER BY c.next_priority, c.next_run_at, c.next_id LIMIT $2)
	)
	SELECT k.key,
		(SELECT count(*) FROM (SELECT FROM leash.jobs h
		        WHERE h.queue = $1 AND h.concurrency_key = k.key AND h.concurrency_key IS NOT NULL
		          AND (h.state = 'running' OR (h.state IN ('available', 'retryable') AND h.attempted_at IS NOT NULL))
		        LIMIT $3) x),
		(SELECT count(*) FROM (SELECT FROM leash.jobs f
		        WHERE f.queue = $1 AND f.concurrency_key = k.key AND f.concurrency_key IS NOT NULL
		          AND f.state IN ('available', 'retryable') AND f.attempted_at IS NULL AND f.run_at <= pg_catalog.now()
		        LIMIT $3) x),
		(SELECT CASE WHEN qq.key_rate_limit = 0 THEN -1
		             WHEN cardinality(r.starts) < qq.key_rate_limit
		               OR r.starts[qq.key_rate_limit] <= pg_catalog.now() - leash.rate_window(qq.key_rate_period) THEN NULL
		             WHEN r.starts[qq.key_rate_limit] > pg_catalog.now() + interval '1 year' THEN -1
		             ELSE extract(epoch FROM r.starts[qq.key_rate_limit] - pg_catalog.now()
		                                     + leash.rate_window(qq.key_rate_period)) * 1000
		        END
		 FROM leash.queues qq LEFT JOIN leash.key_rates r ON r.queue = qq.name AND r.key = k.key
		 WHERE qq.name = $1 AND qq.key_rate_limit IS NOT NULL)
	FROM keys k`

// ReadKeyUse returns the use of at most 3×keys keys of queue: the first keys keys (in key order)
// that jobs hold, the first keys keys that have jobs not yet started, and the first keys keys in
// the order the queue's claims walk them (the keys with a job to claim, kept only for a queue
// with a per-key limit). Holders and Waiting are counted up
// to upTo each (upTo means at least that many). Its cost is bounded by keys and upTo, whatever
// the number of the queue's jobs and keys: it reads index entries only (keyUseSQL).
func ReadKeyUse(ctx context.Context, db DBTX, queue string, keys, upTo int) ([]KeyUse, error) {
	rows, err := db.Query(ctx, keyUseSQL, queue, keys, upTo)
	if err != nil {
		return nil, fmt.Errorf("read the keys of queue %q: %w", queue, err)
	}
	defer rows.Close()
	var out []KeyUse
	for rows.Next() {
		var u KeyUse
		var wait *float64
		if err := rows.Scan(&u.Key, &u.Holders, &u.Waiting, &wait); err != nil {
			return nil, fmt.Errorf("read the keys of queue %q: %w", queue, err)
		}
		if wait != nil {
			u.OutOfRate = true
			if *wait >= 0 { // -1: a limit of 0, never
				u.RateWait = max(time.Duration(*wait*float64(time.Millisecond)).Round(time.Millisecond), time.Millisecond)
			}
		}
		out = append(out, u)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the keys of queue %q: %w", queue, err)
	}
	return out, nil
}
