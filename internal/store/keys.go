package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Per-key concurrency (migration 025). A job holds its key (leash.jobs.concurrency_key) from its
// first start until it is finished: while it runs and while, started, it waits to run again
// (attempted_at is set). A queue with max_running_per_key is claimed by ClaimKeyed alone, under
// the queue's row as a capped queue is, so that the claims of the queue run one at a time across
// all workers and each counts the holders of its keys in a snapshot that sees every claim before
// it: never more than max_running_per_key holders of one key. leash.concurrency_keys lists the
// keys that have a job to claim, at that job's position, and the claim walks it in order, so it
// never walks the jobs of a key at its limit.

// claimKeyedSQL claims from a queue with a per-key limit, after lockQueueRowSQL (mark $5) in
// the same READ COMMITTED transaction: leash.claim_keyed_pick (migration 025) chooses the jobs,
// at most $2, in statements planned once per session; this statement locks them by ctid (a job
// another transaction holds is passed over, never the one after it taken in its place, so a key's
// order holds; a row changed since has another ctid and is passed over too) and leases them. $6:
// look for the queue's jobs without a key too.
var claimKeyedSQL = fmt.Sprintf(`
	WITH picked AS (
		SELECT j.id, j.ctid FROM leash.jobs j
		WHERE j.ctid = ANY (ARRAY(SELECT pg_catalog.unnest(leash.claim_keyed_pick($1, $2::int, $5, $6::boolean))))
		FOR UPDATE OF j SKIP LOCKED
	)`+claimTail, claimTraceContextBytes)

// claimKeyedWakesSQL brings the keys woken since the last claim up to date, in a transaction of
// its own holding the queue's row (mark $2) just before the claim's.
const claimKeyedWakesSQL = `SELECT leash.claim_keyed_wakes($1, $2)`

// claimKeyedFinishSQL records the claim's starts under the queue's rate limits and brings the keys
// the claim walked up to date, after it leased their jobs (leash.claim_keyed_finish, migration
// 029); it returns how many milliseconds until the queue's next key comes due, or its rate limit
// has room again (NULL: no such time).
const claimKeyedFinishSQL = `SELECT leash.claim_keyed_finish($1, $2)`

// claimKeyedLockTimeoutSQL bounds every lock wait of a keyed claim's transactions. Under the
// queue's row no other claim writes the queue's rows of leash.concurrency_keys and leash.key_wakes
// and the jobs are taken SKIP LOCKED, so a wait is for a session holding such a row or table (an
// operator's forgotten SELECT ... FOR UPDATE, or FOR KEY SHARE, which a DELETE waits for): the
// claim of this queue fails after 100ms, as leash.rate_take does, rather than keep the worker's
// claim, and with it the claims of its other queues, waiting until that session ends.
const claimKeyedLockTimeoutSQL = `SET LOCAL lock_timeout = '100ms'`

// KeyedParams are ClaimParams for ClaimKeyed, and whether to look for the queue's jobs without a
// key too whether or not some were inserted or queued again since the last claim that looked
// (their walk passes over the queue's keyed jobs, so it is made only when there is reason to
// expect some: see pool's claim).
type KeyedParams struct {
	ClaimParams
	Unkeyed bool
}

// ClaimKeyed leases up to p.Limit runnable jobs of p.Queues[0], a queue with a per-key limit
// (max_running_per_key) or a per-key rate limit (key_rate_limit): never so many that more than
// that many jobs of one key hold it across all workers, nor more starts of one key in a window
// than its rate allows, nor more than the queue's max_running run or its rate limit allows; none
// while it is paused. Two READ COMMITTED transactions, in one round trip, each holding the queue's
// row: the first brings the keys woken since the last claim up to date; the second claims and
// brings the walked keys up to date. next is how long until the queue has a key coming due that
// has nothing to claim now (a job scheduled for later, a key or the queue out of room under its
// rate): 0 when there is none. It returns ErrQueueBusy, having claimed nothing, when the queue's
// row is held.
func ClaimKeyed(ctx context.Context, db Batcher, p KeyedParams) (jobs []ClaimedJob, next time.Duration, err error) {
	if len(p.Queues) != 1 {
		return nil, 0, fmt.Errorf("claim jobs of a queue with a per-key limit: want one queue, got %d", len(p.Queues))
	}
	q := p.Queues[0]
	b := &pgx.Batch{}
	// The woken keys, in a transaction of their own (see leash.claim_keyed_wakes); what it writes
	// is derived from leash.jobs and redone should it be lost, so its commit does not wait for
	// the disk.
	b.Queue(`BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE`)
	b.Queue(claimKeyedLockTimeoutSQL)
	b.Queue(`SET LOCAL synchronous_commit = off`)
	wakeMark := strconv.FormatUint(rand.Uint64(), 36)
	b.Queue(lockQueueRowSQL, q, wakeMark)
	b.Queue(claimKeyedWakesSQL, q, wakeMark)
	b.Queue(`COMMIT`)
	b.Queue(`BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE`)
	b.Queue(claimKeyedLockTimeoutSQL)
	mark := strconv.FormatUint(rand.Uint64(), 36)
	b.Queue(lockQueueRowSQL, q, mark)
	b.Queue(claimKeyedSQL, q, p.Limit, p.WorkerID, millis(p.Lease), mark, p.Unkeyed)
	b.Queue(claimKeyedFinishSQL, q, mark)
	b.Queue(`COMMIT`)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	for _, step := range []string{"begin", "bound lock waits", "set synchronous_commit", "lock the queue's row",
		"bring woken keys up to date", "commit", "begin", "bound lock waits"} {
		if _, err := br.Exec(); err != nil {
			return nil, 0, fmt.Errorf("claim jobs of queue %q: %s: %w", q, step, err)
		}
	}
	tag, err := br.Exec()
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: lock the queue's row: %w", q, err)
	}
	locked := tag.RowsAffected() > 0
	rows, err := br.Query()
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	jobs, err = scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	var ms *float64
	if err := br.QueryRow().Scan(&ms); err != nil {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: bring walked keys up to date: %w", q, err)
	}
	if _, err := br.Exec(); err != nil {
		// Nothing committed: the rows the claim leased are available again.
		return nil, 0, fmt.Errorf("claim jobs of queue %q: commit: %w", q, err)
	}
	if err := br.Close(); err != nil {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: %w", q, err)
	}
	if !locked && len(jobs) == 0 {
		return nil, 0, fmt.Errorf("claim jobs of queue %q: %w", q, ErrQueueBusy)
	}
	if ms != nil && *ms > 0 {
		next = time.Duration(*ms * float64(time.Millisecond))
	}
	return jobs, next, nil
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

// SetQueueKeyRateLimit sets the queue's per-key rate limit (leash.set_queue_key_rate_limit): at
// most *n starts of one key in any window of period; nil removes it.
func SetQueueKeyRateLimit(ctx context.Context, db DBTX, name string, n *int, period time.Duration) (bool, error) {
	var per any
	if n != nil && period > 0 {
		per = interval(period)
	}
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.set_queue_key_rate_limit($1, $2, $3::interval)`, name, n, per).Scan(&changed); err != nil {
		return false, fmt.Errorf("set the per-key rate limit of queue %q: %w", name, err)
	}
	return changed, nil
}
