package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Rate limits (migration 025). A queue with rate_limit R is claimed by ClaimRated, under the
// queue's row as a capped queue is, so that its claims run one at a time across all workers;
// each claim starts no more jobs than the ring of leash.rate_slots has free slots (a slot is free
// once its last start is a rate_period old) and writes its starts there, so that no window of
// rate_period ever holds more than R starts.

// claimRatedOneSQL is claimCappedOneSQL for a queue with a rate limit (which the capped claim,
// and the uncapped claims' gates, refuse: they do not write starts), its room further bounded
// by leash.rate_room.
var claimRatedOneSQL = mustReplace(mustReplace(claimCappedOneSQL,
	"\n\t\t                 OR q.rate_limit IS NOT NULL THEN 0", " THEN 0"),
	"LIMIT (SELECT coalesce(min(n), 0) FROM room)",
	"LIMIT (SELECT leash.rate_room($1, $5::text, coalesce(min(n), 0)::int) FROM room)")

// mustReplace replaces the one occurrence of old in s by new; it panics (at package init, so in
// every test) when s does not hold old exactly once, rather than let a statement built from
// another lose its change silently.
func mustReplace(s, old, new string) string {
	if strings.Count(s, old) != 1 {
		panic(fmt.Sprintf("store: statement holds %q %d times, want once", old, strings.Count(s, old)))
	}
	return strings.Replace(s, old, new, 1)
}

// rateTakeSQL writes the starts of the claim of queue $1 (mark $2, worker $3) into the ring and
// returns how many milliseconds until the ring has a free slot again (NULL: no rate limit). The
// starts are the rows this transaction leased: the worker's running jobs of the queue with
// attempted_at the transaction's now() and written by this transaction.
const rateTakeSQL = `
	SELECT leash.rate_take($1, $2, (
		SELECT count(*) FROM leash.jobs j
		WHERE j.queue = $1 AND j.leased_by = $3 AND j.state = 'running' AND j.attempted_at = pg_catalog.now()
		  AND j.xmin::text = (pg_catalog.pg_current_xact_id()::text::bigint % 4294967296)::text)::int)`

// ClaimRated leases up to p.Limit runnable jobs of p.Queues[0], a queue with a rate limit (and
// maybe a cap): never more starts in any window of the queue's rate_period than its rate_limit
// across all workers, nor more running than its max_running; none while it is paused. One READ
// COMMITTED transaction in one round trip. next is how long until the rate limit lets the queue
// start a job again: 0 when it may now (or has no limit). It returns ErrQueueBusy, having
// claimed nothing, when the queue's row is held.
func ClaimRated(ctx context.Context, db Batcher, p ClaimParams) (jobs []ClaimedJob, next time.Duration, err error) {
	if len(p.Queues) != 1 {
		return nil, 0, fmt.Errorf("claim jobs of a rate-limited queue: want one queue, got %d", len(p.Queues))
	}
	q := p.Queues[0]
	b := &pgx.Batch{}
	b.Queue(`BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE`)
	mark := strconv.FormatUint(rand.Uint64(), 36)
	b.Queue(lockQueueRowSQL, q, mark)
	b.Queue(claimRatedOneSQL, q, p.Limit, p.WorkerID, millis(p.Lease), mark)
	b.Queue(rateTakeSQL, q, mark, p.WorkerID)
	b.Queue(`COMMIT`)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: begin: %w", q, err)
	}
	tag, err := br.Exec()
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: lock the queue's row: %w", q, err)
	}
	locked := tag.RowsAffected() > 0
	rows, err := br.Query()
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: %w", q, err)
	}
	jobs, err = scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: %w", q, err)
	}
	var ms *float64
	if err := br.QueryRow().Scan(&ms); err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: record the starts: %w", q, err)
	}
	if _, err := br.Exec(); err != nil {
		// Nothing committed: the rows the claim leased are available again.
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: commit: %w", q, err)
	}
	if err := br.Close(); err != nil {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: %w", q, err)
	}
	if !locked && len(jobs) == 0 {
		return nil, 0, fmt.Errorf("claim jobs of rate-limited queue %q: %w", q, ErrQueueBusy)
	}
	if ms != nil && *ms > 0 {
		next = time.Duration(*ms * float64(time.Millisecond))
	}
	return jobs, next, nil
}

// SetQueueRateLimit sets the queue's rate limit (leash.set_queue_rate_limit): at most n starts in
// any window of period across all workers; nil n removes it. It reports whether it changed.
func SetQueueRateLimit(ctx context.Context, db DBTX, name string, n *int, period time.Duration) (bool, error) {
	var per any
	if n != nil && period > 0 {
		per = interval(period)
	}
	var changed bool
	if err := db.QueryRow(ctx, `SELECT leash.set_queue_rate_limit($1, $2, $3::interval)`, name, n, per).Scan(&changed); err != nil {
		return false, fmt.Errorf("set rate limit of queue %q: %w", name, err)
	}
	return changed, nil
}
