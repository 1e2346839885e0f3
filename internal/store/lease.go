package store

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// ClaimParams selects and leases runnable jobs.
type ClaimParams struct {
	Queues   []string
	Limit    int
	WorkerID string
	Lease    time.Duration
	// After, for a single queue, starts the claim's index scan past this position (the last job
	// claimed) instead of at the queue's first entry (see ClaimCursor).
	After *ClaimCursor
	// Lag, with After, also takes jobs of After's priority whose run_at lies within Lag before
	// After's: an insert whose transaction began before the last claimed job's (run_at is its
	// transaction's start) but committed after that claim lands there.
	Lag time.Duration
	// RecheckFromID, with After, also takes jobs of After's very priority and run_at whose id is
	// at least RecheckFromID and below After's: those recent claims passed over (locked by
	// another transaction then, or committed late with the same run_at, as scheduled ticks of
	// one instant are). The caller sets it to where its claims stood Lag ago, so that the
	// entries of the thousands of jobs a COPY gave one run_at, claimed long since (kept in the
	// index while an old snapshot holds vacuum back), are not walked again at every claim.
	RecheckFromID int64
}

// ClaimCursor is a position in a queue's claim order (priority, run_at, id). A claim that starts
// past the last job it claimed skips the index entries of jobs already claimed, which vacuum
// cannot remove while an old snapshot (a long report, a forgotten BEGIN) holds the xmin horizon
// back: without it, each claim walks all of them, and claims slow down as they pile up. Jobs
// that become runnable before the cursor (a higher priority, a run_at in the past, a claim
// rolled back) are found by the next claim that starts at the front: the caller does that
// regularly.
type ClaimCursor struct {
	Priority int16
	RunAt    time.Time
	ID       int64
}

// Less reports whether c comes before d in claim order.
func (c ClaimCursor) Less(d ClaimCursor) bool {
	if c.Priority != d.Priority {
		return c.Priority < d.Priority
	}
	if !c.RunAt.Equal(d.RunAt) {
		return c.RunAt.Before(d.RunAt)
	}
	return c.ID < d.ID
}

// LastClaimed returns the position of the last of jobs in claim order. Jobs whose run_at is not
// finite (-infinity, written by some SQL client) give no position: they sort before every finite
// one, where only a claim from the front finds them.
func LastClaimed(jobs []ClaimedJob) *ClaimCursor {
	var last ClaimCursor
	found := false
	for i := range jobs {
		if jobs[i].RunAt.IsZero() {
			continue
		}
		c := ClaimCursor{Priority: jobs[i].Priority, RunAt: jobs[i].RunAt, ID: jobs[i].ID}
		if !found || last.Less(c) {
			last, found = c, true
		}
	}
	if !found {
		return nil
	}
	return &last
}

// ClaimedJob is a row just leased to this worker.
type ClaimedJob struct {
	ID          int64
	Queue       string
	Kind        string
	Payload     []byte
	Priority    int16
	Attempt     int32
	MaxAttempts int32
	Token       int64
	CreatedAt   time.Time
	RunAt       time.Time
	AttemptedAt time.Time
	// Timeout is the job's own limit for one attempt; zero when the row has none.
	Timeout time.Duration
	// TraceContext is the row's trace_context as JSON text when it is an object of at most
	// twice MaxTraceContextBytes as jsonb text (anything else any SQL client wrote reads as nil,
	// never as an error).
	TraceContext []byte
	// ConcurrencyKey is the row's concurrency_key; empty when it has none.
	ConcurrencyKey string
	// SetAside: the row could not be leased (its attempt counter is at the largest integer,
	// which only an SQL client writes) and the claim failed it instead, with an error naming
	// why. It holds no lease (Token is 0) and must not run; it still counts as a position in
	// the queue's claim order.
	SetAside bool
}

// MaxTraceContextBytes bounds the trace_context a claim reads back: a W3C traceparent is 55
// bytes and a tracestate at most 512, so anything longer is not a trace context.
const MaxTraceContextBytes = 4096

// claimTraceContextBytes is the bound as the claim measures it, on jsonb's own text, which spaces
// out what an insert measured compactly (": " and ", "): room for that, never an accepted trace
// context read back as none.
const claimTraceContextBytes = 2 * MaxTraceContextBytes

// claimTail leases the picked rows and returns them. It finds each row by the ctid the pick
// locked (a TID scan), not by a join on id: a generic plan made while leash.jobs was empty or
// never analyzed joins on id by hashing a sequential scan of the whole table, and with an old
// snapshot keeping every dead row that scan grows with every job claimed until the next ANALYZE
// (8 ms for 100 jobs with 20,000 rows in the table, measured, and more with every claim). The
// ctids and ids are arrays, not a join with the picked rows: a join lets a plan made on an empty
// or one-page table walk the whole of jobs_pkey (or scan the table) for the rows, which as a
// cached generic plan cost seconds a claim once the table had grown; with arrays and no
// sequential scan (claimPlanSQL) the only paths are the TID scan and, on a table that looks
// empty, one primary-key probe per id. A row's ctid names one of its versions, so a row is
// leased only at the version the pick locked.
// A row another transaction updated between the statement's snapshot and the pick's lock is
// locked but not leased, and stays in the queue for the next claim.
// A picked row that cannot be leased (its attempt counter has no room for one more claim, see
// claimableSQL) is set aside instead: failed, with an error naming why, and returned with
// SetAside, so that one row written by any SQL client never makes the claim fail for the others.
const claimTail = `
	UPDATE leash.jobs j
	SET state = CASE WHEN ` + claimableSQL + ` THEN 'running' ELSE 'failed' END,
	    attempt = CASE WHEN ` + claimableSQL + ` THEN j.attempt + 1 ELSE j.attempt END,
	    lease_token = CASE WHEN ` + claimableSQL + ` THEN nextval('leash.lease_tokens') END,
	    leased_by = CASE WHEN ` + claimableSQL + ` THEN $3 END,
	    lease_expires_at = CASE WHEN ` + claimableSQL + ` THEN now() + $4 * interval '1 millisecond' END,
	    heartbeat_at = CASE WHEN ` + claimableSQL + ` THEN now() ELSE j.heartbeat_at END,
	    attempted_at = CASE WHEN ` + claimableSQL + ` THEN now() ELSE j.attempted_at END,
	    -- Set aside:
	    finished_at = CASE WHEN ` + claimableSQL + ` THEN j.finished_at ELSE now() END,
	    last_error = CASE WHEN ` + claimableSQL + ` THEN j.last_error ELSE ` + setAsideErrorSQL + ` END,
	    errors = CASE WHEN ` + claimableSQL + ` THEN j.errors ELSE ` + errorsHistorySQL + ` || jsonb_build_array(
	        jsonb_build_object('at', now(), 'attempt', j.attempt, 'error', ` + setAsideErrorSQL + `)) END
	WHERE j.ctid = ANY (ARRAY(SELECT picked.ctid FROM picked)) AND j.id = ANY (ARRAY(SELECT picked.id FROM picked))
	RETURNING ` + claimReturning

// claimReturning is what a claim returns of each row (%d: claimTraceContextBytes); a row set
// aside (failed) has no lease token.
const claimReturning = `j.id, j.queue, j.kind, j.payload, j.priority, j.attempt, j.max_attempts, coalesce(j.lease_token, 0),
	          j.created_at, j.run_at, j.attempted_at, ` + timeoutMillisSQL + `,
	          CASE WHEN jsonb_typeof(j.trace_context) = 'object'
	                AND octet_length(j.trace_context::text) <= %d
	               THEN j.trace_context::text END,
	          j.state = 'failed', j.concurrency_key`

// claimableSQL says whether a picked row can be leased: its attempt counter has room for one
// more claim. The table refuses a queued row at the largest integer (sql/013); rows older than
// that check may hold it, and the claim sets them aside.
const claimableSQL = `j.attempt < 2147483647`

// setAsideErrorSQL is the error a set-aside row is failed with.
const setAsideErrorSQL = `'not claimed: its attempt counter (' || j.attempt || ') has no room for another claim'`

// timeoutMillisSQL reads j.timeout as whole milliseconds (rounded up; 0 when NULL) in the
// arithmetic of the table's check, interval comparison: a month is 30 days and a day 24 hours,
// whatever the interval mixes. extract(epoch ...) alone counts a year as 365.25 days, which let
// an interval the check sees as one day ('-1 year 361 days') read as minus 102 hours: no limit.
// Every row the check let in reads between 1 ms and 100 days; the bounds hold regardless.
const timeoutMillisSQL = `CASE WHEN j.timeout IS NULL THEN 0 ELSE greatest(1, least(8640000000, ceil(
	              (extract(year FROM j.timeout) * 360 + extract(month FROM j.timeout) * 30 + extract(day FROM j.timeout)) * 86400000
	              + extract(hour FROM j.timeout) * 3600000 + extract(minute FROM j.timeout) * 60000
	              + extract(microseconds FROM j.timeout) / 1000)))::bigint END`

const claimSQL = `
	WITH picked AS (
		SELECT id, ctid FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND %s AND run_at <= now() AND revoked_at IS NULL
		ORDER BY priority, run_at, id
		LIMIT $2
		FOR UPDATE SKIP LOCKED
	)` + claimTail

// queueGateSQL is the claim's guard on queue $1's leash.queues row: the row, while it neither
// pauses nor caps the queue, locked FOR SHARE for the rest of the claim's transaction. A change
// to the row (UPDATE, DELETE, pause_queue, SetQueueMaxRunning, any SQL client's) locks it FOR NO
// KEY UPDATE or stronger, which conflicts: it waits for the claims that hold the row, and the
// claims that come after it skip the row (SKIP LOCKED: they take nothing of the queue) until it
// has committed or rolled back, then lock its new version, which READ COMMITTED re-reads however
// old the claim's snapshot. So no claim that read the old setting commits after a pause or cap
// does: both are exact from their commit. A FOR SHARE request is granted at once while other
// claims share the row, even when a change waits for it: while a change waits (queueChangeHintSQL)
// claims take no row, so that a busy queue can still be paused. A queue without a row is not
// claimed by this statement; the pool creates the rows of its queues (EnsureQueues) before it
// claims. Locking the row takes the UPDATE privilege on leash.queues, which roles without grants
// lack: they cannot hold the row, and so cannot stall claims.
var queueGateSQL = `SELECT FROM leash.queues q WHERE q.name = $1 AND q.paused_at IS NULL AND q.max_running IS NULL
	AND q.max_running_per_key IS NULL AND q.rate_limit IS NULL AND q.key_rate_limit IS NULL AND ` +
	queueChangeHintSQL + ` FOR SHARE SKIP LOCKED`

// queueChangeHintSQL is true unless a change to leash.queues has been waiting for its rows for
// less than half a second (see migration 010): a change waits for the claims holding the row
// only, never for those that would come after it.
const queueChangeHintSQL = `(SELECT h.last_value FROM leash.queue_change_hint h) < (extract(epoch FROM now()) * 1000)::bigint - 500`

// The claim of uncapped queues takes only queues whose leash.queues row neither pauses nor caps
// them (see queueGateSQL). A capped queue is claimed by ClaimCapped instead.
var (
	claimOneQueueSQL = fmt.Sprintf(strings.Replace(claimSQL, "WITH picked AS (", "WITH gate AS ("+queueGateSQL+"), picked AS (", 1),
		`queue = $1 AND EXISTS (SELECT FROM gate)`, claimTraceContextBytes)
	// Past a cursor: three index ranges, in claim order, each locked only as far as needed: the
	// cursor's priority within the lag before its run_at; its priority and run_at from the id
	// where the claims stood a lag ago; everything after it.
	claimOneQueueAfterSQL = fmt.Sprintf(`
	WITH gate AS (`+queueGateSQL+`), lagged AS (
		SELECT id, ctid FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND queue = $1 AND priority = $5::smallint
		  AND run_at >= $8::timestamptz AND run_at < $6::timestamptz AND run_at <= now() AND revoked_at IS NULL
		  AND EXISTS (SELECT FROM gate)
		ORDER BY priority, run_at, id
		LIMIT $2
		FOR UPDATE SKIP LOCKED
	), passed AS (
		SELECT id, ctid FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND queue = $1 AND priority = $5::smallint
		  AND run_at = $6::timestamptz AND id >= $9::bigint AND id < $7::bigint AND run_at <= now() AND revoked_at IS NULL
		  AND EXISTS (SELECT FROM gate)
		ORDER BY priority, run_at, id
		LIMIT $2 - (SELECT count(*) FROM lagged)
		FOR UPDATE SKIP LOCKED
	), ahead AS (
		SELECT id, ctid FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND queue = $1
		  AND (priority, run_at, id) > ($5::smallint, $6::timestamptz, $7::bigint) AND run_at <= now() AND revoked_at IS NULL
		  AND EXISTS (SELECT FROM gate)
		ORDER BY priority, run_at, id
		LIMIT $2 - (SELECT count(*) FROM lagged) - (SELECT count(*) FROM passed)
		FOR UPDATE SKIP LOCKED
	), picked AS (
		SELECT id, ctid FROM lagged UNION ALL SELECT id, ctid FROM passed UNION ALL SELECT id, ctid FROM ahead
	)`+claimTail, claimTraceContextBytes)
	// Several queues: the head of each active queue through its own index scan (LATERAL), then
	// the first $2 of those heads in claim order. One scan across the queues (queue = ANY(...))
	// is planned as a bitmap scan and a sort of every queued row of them. Heads locked but not
	// taken are unlocked at commit, a few milliseconds later, still available. Each queue's row
	// is its gate, as in queueGateSQL.
	claimManyQueuesSQL = fmt.Sprintf(`
	WITH gate AS (
		SELECT q.name FROM leash.queues q
		WHERE q.name = ANY($1::text[]) AND q.paused_at IS NULL AND q.max_running IS NULL AND q.max_running_per_key IS NULL
		  AND q.rate_limit IS NULL AND q.key_rate_limit IS NULL AND `+queueChangeHintSQL+`
		FOR SHARE SKIP LOCKED
	), heads AS (
		SELECT h.id, h.ctid, h.priority, h.run_at
		FROM gate AS a
		CROSS JOIN LATERAL (
			SELECT id, ctid, priority, run_at FROM leash.jobs
			WHERE state IN ('available', 'retryable') AND queue = a.name AND run_at <= now() AND revoked_at IS NULL
			ORDER BY priority, run_at, id
			LIMIT $2
			FOR UPDATE SKIP LOCKED) h
	), picked AS (
		SELECT id, ctid FROM heads ORDER BY priority, run_at, id LIMIT $2
	)`+claimTail, claimTraceContextBytes)
)

// lockQueueRowSQL takes a capped queue's row for one claim: FOR UPDATE, so that the claims of
// the queue, on every worker, run one at a time, and a change to the row waits for the claim in
// flight (and the claim for a change in flight). It never waits: a row another claim holds is
// skipped, and the queue is claimed in a later round (a claim holds it for a few milliseconds),
// so a capped queue never delays the claims of the worker's other queues. Holding the row takes
// the UPDATE privilege on leash.queues: a role without grants cannot stall the queue. What the
// statement returns says whether the row was taken; it also marks the transaction so that the
// claim that follows takes nothing unless it was: set_config runs only for the row locked, and
// sets $2, a value drawn for this claim alone, so that no value a session or role starts with
// can pass for the mark.
const lockQueueRowSQL = `
	SELECT pg_catalog.set_config('leash.capped_claim', $2, true)
	FROM (SELECT FROM leash.queues q WHERE q.name = $1 FOR UPDATE SKIP LOCKED) AS locked`

// claimCappedSQL claims from one capped or paused queue. It runs after lockQueueRowSQL in the
// same READ COMMITTED transaction: with the queue's row held, no other claim of the queue is in
// flight and no change to the row commits, and this statement's snapshot (taken after the lock
// was granted) sees every claim of the queue committed before it, so its count of running jobs
// is exact and the cap holds across workers from the moment a change commits. Without the row
// held (another claim has it, or it is gone) it takes nothing.
var claimCappedSQL = strings.Replace(strings.Replace(claimSQL,
	"WITH picked AS (", `WITH room AS (
		SELECT CASE WHEN q.paused_at IS NOT NULL OR q.max_running_per_key IS NOT NULL OR q.key_rate_limit IS NOT NULL
		                 OR q.rate_limit IS NOT NULL THEN 0
		            WHEN q.max_running IS NULL THEN $2::int
		            ELSE greatest(0, least($2::int, q.max_running - (
		                SELECT count(*) FROM leash.jobs r WHERE r.queue = $1 AND r.state = 'running')::int))
		       END AS n
		FROM leash.queues q
		WHERE q.name = $1 AND pg_catalog.current_setting('leash.capped_claim', true) = $5::text
	), picked AS (`, 1),
	"LIMIT $2", "LIMIT (SELECT coalesce(min(n), 0) FROM room)", 1)

var claimCappedOneSQL = fmt.Sprintf(claimCappedSQL, "queue = $1", claimTraceContextBytes)

// ErrQueueBusy means a capped queue's claim found the queue's row held: by another worker's
// claim of the queue (for a few milliseconds), or by a change to the row not yet committed.
var ErrQueueBusy = errors.New("capped queue's row held by another claim or a change in progress")

// ClaimCapped leases up to p.Limit runnable jobs of p.Queues[0], a queue leash.queues may pause
// or cap: never so many that more than its max_running jobs run at once across all workers,
// none while it is paused. One transaction, READ COMMITTED whatever the session's default (the
// count of running jobs must see what committed while the row was waited for), in one round
// trip. It returns ErrQueueBusy, having claimed nothing, when the queue's row is held.
func ClaimCapped(ctx context.Context, db Batcher, p ClaimParams) ([]ClaimedJob, error) {
	if len(p.Queues) != 1 {
		return nil, fmt.Errorf("claim jobs of a capped queue: want one queue, got %d", len(p.Queues))
	}
	q := p.Queues[0]
	b := &pgx.Batch{}
	b.Queue(`BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE`)
	mark := strconv.FormatUint(rand.Uint64(), 36)
	b.Queue(lockQueueRowSQL, q, mark)
	b.Queue(claimPlanSQL)
	b.Queue(claimCappedOneSQL, q, p.Limit, p.WorkerID, millis(p.Lease), mark)
	b.Queue(`COMMIT`)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim jobs of capped queue %q: begin: %w", q, err)
	}
	tag, err := br.Exec()
	if err != nil {
		return nil, fmt.Errorf("claim jobs of capped queue %q: lock the queue's row: %w", q, err)
	}
	locked := tag.RowsAffected() > 0
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim jobs of capped queue %q: %w", q, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim jobs of capped queue %q: %w", q, err)
	}
	jobs, err := scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, err
	}
	if _, err := br.Exec(); err != nil {
		// Nothing committed: the rows the claim leased are available again.
		return nil, fmt.Errorf("claim jobs of capped queue %q: commit: %w", q, err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim jobs of capped queue %q: %w", q, err)
	}
	if !locked && len(jobs) == 0 {
		return nil, fmt.Errorf("claim jobs of capped queue %q: %w", q, ErrQueueBusy)
	}
	return jobs, nil // leased: the caller starts them, whatever else happened
}

// EnsureQueues creates a row in leash.queues (active, uncapped, marked implicit) for each of
// names that has none: claims take a queue only through its row (see queueGateSQL). Each row is
// created by a statement of its own and never waited for long: a row another client is
// inserting and has not committed (an open BEGIN; SELECT leash.pause_queue(...) in psql) is left
// to that client, and the others are created all the same. It returns the first error, having
// tried every name.
func EnsureQueues(ctx context.Context, db DBTX, names []string) error {
	var first error
	seen := make(map[string]bool, len(names))
	for _, n := range names {
		if seen[n] {
			continue
		}
		seen[n] = true
		// lock_timeout is set by the statement itself, for its own (implicit) transaction: the
		// INSERT waits for a conflicting row another transaction is inserting.
		_, err := db.Exec(ctx, `
			WITH bounded AS (SELECT pg_catalog.set_config('lock_timeout', '100ms', true))
			INSERT INTO leash.queues (name, implicit) SELECT $1, true FROM bounded
			WHERE NOT EXISTS (SELECT FROM leash.queues q WHERE q.name = $1)
			ON CONFLICT (name) DO NOTHING`, n)
		if err != nil && first == nil {
			first = fmt.Errorf("create the control row of queue %q in leash.queues: %w", n, err)
		}
	}
	return first
}

// Claim leases up to p.Limit runnable jobs in one statement (after claimPlanSQL, in the same
// round trip and transaction), in priority, run_at, id order, skipping rows other workers hold
// locked.
func Claim(ctx context.Context, db Batcher, p ClaimParams) ([]ClaimedJob, error) {
	q, args := claimQuery(p)
	b := &pgx.Batch{}
	b.Queue(claimPlanSQL)
	b.Queue(q, args...)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		// pgx reports here what failed before the claim returned anything: preparing it, the
		// connection, the context.
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	jobs, err := scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, err
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	return jobs, nil
}

// claimPlanSQL runs before every claim statement, in the claim's transaction (a pipeline under
// one Sync, or an explicit transaction): the claim then runs the generic plan its prepared
// statement keeps, planned once per connection (and again when leash.jobs' statistics change),
// rather than a custom plan made anew at every claim. Under PostgreSQL's default
// plan_cache_mode a claim was planned at every execution: its generic plan counts LIMIT $2 as a
// tenth of the queued rows, so it always looks dearer than a custom plan for 100, and planning
// the claim's three ranges took as long as running them (3.5 ms and 3.7 ms for 100 jobs; in a
// burn-down 373 plans for 485 claims). Reckoned for that tenth, a generic plan would rather
// hash or scan leash.jobs than probe it once per row (44 ms for 100 of 50,000 rows), and one
// made while the table was empty or a page long (an idle night after retention) scanned it for
// every claim once cached (4 s a claim of 100 once 200,000 rows had come; 3 ms by TID). So hash
// and merge joins and sequential scans are off, and the paths the claims need (index and TID
// scans, the nested loop of the several-queue claim) on, whatever a role or database set; see
// claimTail. JIT is off: a generic plan's cost can pass jit_above_cost, and compiling would cost
// more than the claim. All hold for the claim's transaction only, and a plan made again is made
// under them.
const claimPlanSQL = `SELECT pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true),
	pg_catalog.set_config('enable_hashjoin', 'off', true), pg_catalog.set_config('enable_mergejoin', 'off', true),
	pg_catalog.set_config('enable_seqscan', 'off', true), pg_catalog.set_config('enable_nestloop', 'on', true),
	pg_catalog.set_config('enable_indexscan', 'on', true), pg_catalog.set_config('enable_tidscan', 'on', true),
	pg_catalog.set_config('jit', 'off', true)`

func claimQuery(p ClaimParams) (string, []any) {
	var queues any = p.Queues
	q := claimManyQueuesSQL
	if len(p.Queues) == 1 {
		q, queues = claimOneQueueSQL, p.Queues[0]
		if a := p.After; a != nil {
			// The lag never reaches before the earliest timestamp PostgreSQL holds, which a job's
			// run_at may be (any SQL client writes it): the claim would fail on the parameter.
			from := a.RunAt.Add(-p.Lag)
			if from.Before(minTimestamp) {
				from = minTimestamp
			}
			return claimOneQueueAfterSQL, []any{queues, p.Limit, p.WorkerID, millis(p.Lease), a.Priority, a.RunAt, a.ID, from, p.RecheckFromID}
		}
	}
	return q, []any{queues, p.Limit, p.WorkerID, millis(p.Lease)}
}

func scanClaimed(rows pgx.Rows, limit int) ([]ClaimedJob, error) {
	defer rows.Close()
	jobs := make([]ClaimedJob, 0, limit)
	// Every row is scanned into the same variables, given to Scan once: what Scan is given
	// escapes to the heap. Every field of j is set at every row. Timestamps written by any SQL
	// client may be ±infinity, which time.Time cannot hold: they are read through pgtype.
	var j ClaimedJob
	var timeoutMS int64
	var created, runAt, attempted pgtype.Timestamptz
	var queue, kind internedText
	var key *string
	dest := []any{&j.ID, &queue, &kind, &j.Payload, &j.Priority, &j.Attempt, &j.MaxAttempts,
		&j.Token, &created, &runAt, &attempted, &timeoutMS, &j.TraceContext, &j.SetAside, &key}
	for rows.Next() {
		// The claim has leased these rows already: a scan that failed would strand them until
		// their leases expired.
		if err := rows.Scan(dest...); err != nil {
			return nil, fmt.Errorf("claim jobs: %w", err)
		}
		j.Queue, j.Kind = queue.s, kind.s
		j.CreatedAt, j.RunAt, j.AttemptedAt = finiteTime(created), finiteTime(runAt), finiteTime(attempted)
		j.Timeout = time.Duration(timeoutMS) * time.Millisecond
		j.ConcurrencyKey = ""
		if key != nil {
			j.ConcurrencyKey = *key
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim jobs: %w", err)
	}
	return jobs, nil
}

// internedText scans a NOT NULL text column into a string, keeping the previous row's string
// when the text is the same: the queue, kind and state of a statement's rows mostly repeat, and
// each would otherwise be a string of its own.
type internedText struct{ s string }

// ScanBytes implements pgtype.BytesScanner.
func (t *internedText) ScanBytes(b []byte) error {
	if b == nil {
		return errors.New("cannot scan NULL into a string")
	}
	if string(b) != t.s {
		t.s = string(b)
	}
	return nil
}

// minTimestamp is the earliest finite timestamptz: 4714-11-24 00:00:00 UTC BC.
var minTimestamp = time.Date(-4713, time.November, 24, 0, 0, 0, 0, time.UTC)

// finiteTime reads a timestamptz as a time.Time: -infinity (and NULL) as the zero time, infinity
// as Never.
func finiteTime(t pgtype.Timestamptz) time.Time {
	if p := timestamptz(t); p != nil {
		return *p
	}
	return time.Time{}
}

// Batcher sends statements in one round trip.
type Batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// FinishAndClaim writes outcomes and claims jobs in one round trip and one transaction: the two
// statements are pipelined under a single Sync, so they commit together, or, if either fails,
// neither does (the caller then writes the outcomes on their own). It is Finish followed by
// Claim, with one commit instead of two.
func FinishAndClaim(ctx context.Context, db Batcher, outs []Outcome, p ClaimParams) ([]Written, []ClaimedJob, error) {
	fq, fargs, err := finishQuery(outs)
	if err != nil {
		return nil, nil, err
	}
	cq, cargs := claimQuery(p)
	b := &pgx.Batch{}
	b.Queue(fq, fargs...)
	b.Queue(claimPlanSQL) // for the claim alone: the outcomes keep their custom plans
	b.Queue(cq, cargs...)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	rows, err := br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("finish jobs: %w", err)
	}
	written, err := scanWritten(rows, len(outs))
	if err != nil {
		return nil, nil, err
	}
	if _, err := br.Exec(); err != nil {
		return nil, nil, fmt.Errorf("claim jobs: %w", err)
	}
	rows, err = br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("claim jobs: %w", err)
	}
	jobs, err := scanClaimed(rows, p.Limit)
	if err != nil {
		return nil, nil, err
	}
	if err := br.Close(); err != nil {
		return nil, nil, fmt.Errorf("finish and claim: %w", err)
	}
	return written, jobs, nil
}

// RenewParams extends many leases at once; IDs[i] is held under Tokens[i].
type RenewParams struct {
	IDs    []int64
	Tokens []int64
	Lease  time.Duration
}

// Renew extends every lease that is still held under its token and not revoked, in one
// statement, and returns the tokens of the leases it extended (a worker may hold two claims of
// one job: one taken over and still stopping, and the current one). It never waits on a row lock: a row another
// transaction holds (a handler's fenced transaction, an operator's revoke_job, an outcome being
// written) is skipped and so missing from the result like a lost one; LeaseStates tells the two
// apart, and the skipped lease is renewed by a later statement or runs out of trust.
func Renew(ctx context.Context, db DBTX, p RenewParams) ([]int64, error) {
	rows, err := db.Query(ctx, renewSQL, p.IDs, p.Tokens, millis(p.Lease))
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	return ids, nil
}

// renewSQL is driven by the leases: each (id, token), in id order, finds its row through the
// primary key and locks it there (LATERAL: one index probe per lease, whatever the statistics),
// so that overlapping renewals and outcome batches lock their rows in the same order. A join of
// the table to the arrays leaves the order of the two to the planner: with statistics that
// count few running rows (taken when few ran, or never), a generic plan read the running jobs
// and scanned the whole array for each of them, a cost in the square of the leases (4 million
// rows filtered out for 2,000 leases). The state is compared with the lease's own column rather
// than a constant, so that no plan can read the running jobs' partial indexes, every running
// row, for each lease instead; the leases' subquery, sorted, is kept as written (never merged
// into the outer query), so the column stays a value read per lease. Locking and its conditions
// stay together: a row another transaction changed since the statement began is checked again
// once locked, on its latest version.
const renewSQL = `
		WITH locked AS (
			SELECT l.id
			FROM (SELECT u.id, u.token, 'running'::text AS state
			      FROM unnest($1::bigint[], $2::bigint[]) AS u(id, token)
			      ORDER BY u.id) AS u
			CROSS JOIN LATERAL (
				SELECT j.id FROM leash.jobs j
				WHERE j.id = u.id AND j.lease_token = u.token AND j.state = u.state AND j.revoked_at IS NULL
				FOR NO KEY UPDATE SKIP LOCKED) AS l
		)
		UPDATE leash.jobs j
		SET lease_expires_at = now() + $3 * interval '1 millisecond', heartbeat_at = now()
		FROM locked
		WHERE j.id = locked.id
		RETURNING j.lease_token`

// LeaseState is what the row says about a lease that was not renewed.
type LeaseState struct {
	ID           int64
	Token        *int64
	State        string
	Revoked      bool
	RevokeReason *string
}

// LeaseStates reads the rows of leases that were not renewed, to tell a revocation from a
// takeover. Ids with no row are absent from the result.
func LeaseStates(ctx context.Context, db DBTX, ids []int64) ([]LeaseState, error) {
	rows, err := db.Query(ctx, `
		SELECT id, lease_token, state, revoked_at IS NOT NULL, revoke_reason
		FROM leash.jobs WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read lease states: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LeaseState, error) {
		var s LeaseState
		err := r.Scan(&s.ID, &s.Token, &s.State, &s.Revoked, &s.RevokeReason)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("read lease states: %w", err)
	}
	return out, nil
}

// Rescued is a running job whose lease expired and that a rescuer took back.
type Rescued struct {
	ID       int64
	OldToken int64  // the token of the claim that lost the job
	OldOwner string // the worker that held it
	State    string // retryable, failed or cancelled
}

// Rescue takes back up to limit running jobs whose lease expired on the database clock, each
// guarded by the token it read: retryable and runnable at once, failed when its attempts are
// used up, cancelled when it was revoked. Each old holder is told on job_revoked with its token.
// Rows another rescuer is working on are skipped.
func Rescue(ctx context.Context, db DBTX, limit int) ([]Rescued, error) {
	rows, err := db.Query(ctx, `
		WITH expired AS (
			SELECT id, lease_token, leased_by FROM leash.jobs
			-- A lease that never ends, or not within a year (written so by some SQL client: no
			-- worker renews for that long), is as good as expired: it would hold its job, and a
			-- capped queue's room, for ever, beyond the reach of revoke_job.
			WHERE state = 'running' AND (lease_expires_at < now() OR NOT pg_catalog.isfinite(lease_expires_at)
			                             OR lease_expires_at > now() + interval '1 year')
			ORDER BY lease_expires_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED
		)
		UPDATE leash.jobs j
		SET state = CASE WHEN j.revoked_at IS NOT NULL THEN 'cancelled'
		                 WHEN j.attempt >= j.max_attempts THEN 'failed'
		                 ELSE 'retryable' END,
		    finished_at = CASE WHEN j.revoked_at IS NOT NULL OR j.attempt >= j.max_attempts THEN now() END,
		    run_at = now(),
		    last_error = 'lease expired: worker ' || coalesce(e.leased_by, '?') || ' stopped renewing',
		    errors = `+errorsHistorySQL+` || jsonb_build_array(jsonb_build_object(
		        'at', now(), 'attempt', j.attempt, 'worker', e.leased_by, 'token', e.lease_token,
		        'error', 'lease expired: worker ' || coalesce(e.leased_by, '?') || ' stopped renewing')),
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		FROM expired e
		WHERE j.id = e.id AND j.lease_token = e.lease_token
		RETURNING j.id, e.lease_token, coalesce(e.leased_by, ''), j.state,
		    leash.notify_revoked(j.id, e.lease_token, 'lease expired', true),
		    CASE WHEN j.state = 'retryable' THEN leash.notify_available(j.queue) END`, limit)
	if err != nil {
		return nil, fmt.Errorf("rescue expired leases: %w", err)
	}
	var out []Rescued
	for rows.Next() {
		var r Rescued
		var notified, notifiedAvailable *bool
		if err := rows.Scan(&r.ID, &r.OldToken, &r.OldOwner, &r.State, &notified, &notifiedAvailable); err != nil {
			rows.Close()
			return nil, fmt.Errorf("rescue expired leases: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("rescue expired leases: %w", err)
	}
	return out, nil
}
