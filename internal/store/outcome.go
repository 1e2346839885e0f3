package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/leashq/leash/internal/clean"
)

// Outcome is the fenced final write for one claim. The worker decides every field; the
// statement only applies it under the fence. The database itself enforces the revocation rule
// (a revoked job that is put back in the queue, or whose attempt fails, ends cancelled), so the
// state written can differ from State: Finish reports what was stored.
type Outcome struct {
	ID    int64
	Token int64
	// State to write: completed, failed, cancelled, retryable, or available (a hand-back).
	State string
	// RunIn is the delay before a retryable or available job may run again (database clock).
	RunIn time.Duration
	// ReturnAttempt gives the attempt back (a hand-back that did not run the job to an end).
	ReturnAttempt bool
	// Error is appended to the errors history (with the database time) and kept as last_error;
	// nil leaves both alone. Its text is cleaned and bounded by Finish.
	Error *AttemptError
	// Revoke, when set, records the revocation the worker learned of (revoked_at, and this
	// reason if the row has none yet).
	Revoke *string
	// Output is the JSON the attempt recorded as the job's result; nil: none, and the column is
	// cleared, so that it never shows an earlier attempt's result (a hand-back, which did not run
	// the job to an end, keeps the column as it was unless it carries one). Cleaned by Finish
	// like progress.
	Output []byte
}

// AttemptError is one entry of a job's errors history.
type AttemptError struct {
	Attempt int32  `json:"attempt"`
	Error   string `json:"error"`
	Worker  string `json:"worker,omitempty"`
	Stack   string `json:"stack,omitempty"`
}

// Written is one outcome Finish stored.
type Written struct {
	ID    int64
	State string // as stored, after the database's revocation rule
	// Frees: the job is in a workflow and has finished (completed, failed or cancelled), so its
	// outcome may have made jobs waiting for it claimable, in the same transaction.
	Frees bool
}

func (o *Outcome) encodeError() (*string, error) {
	if o.Error == nil {
		return nil, nil
	}
	e := *o.Error
	e.Error = clean.Text(e.Error, MaxErrorBytes)
	e.Stack = clean.Text(e.Stack, MaxStackBytes)
	e.Worker = clean.Text(e.Worker, 256)
	b, err := json.Marshal(e)
	if err != nil {
		return nil, fmt.Errorf("encode attempt error of job %d: %w", o.ID, err)
	}
	s := string(b)
	return &s, nil
}

// Finish writes many outcomes in one statement, each guarded by its id and lease token, and
// returns what it wrote. It never waits on a row lock for long. An id missing from the result
// had lost its lease, or its row was locked by another transaction (StillHeld tells them
// apart): nothing was written for it. An outcome of a workflow's job whose release or
// cancellation finds rows held by another transaction past outcomeLockWait (a fan-out adding a
// dependent, a forgotten FOR UPDATE) fails its statement with SQLSTATE 55P03: outside a
// transaction, Finish then writes the batch in halves, so that the held outcome alone is left
// out, as a locked row is; in a transaction (db a pgx.Tx) the error is returned. Any other
// statement error fails the whole batch; the caller splits it to find the bad item. An error
// met after some halves were written (a deadline, a lost connection) is returned with what they
// wrote: those outcomes are committed, and a retry of them finds their leases gone.
func Finish(ctx context.Context, db DBTX, outs []Outcome) ([]Written, error) {
	q, args, err := finishQuery(outs)
	if err != nil {
		return nil, err
	}
	var ws []Written
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		err = fmt.Errorf("finish jobs: %w", err)
	} else {
		ws, err = scanWritten(rows, len(outs))
	}
	if err == nil || !lockNotAvailable(err) {
		return ws, err
	}
	if _, inTx := db.(pgx.Tx); inTx {
		return nil, err
	}
	if len(outs) == 1 {
		return nil, nil // held: the caller tries it again later
	}
	mid := len(outs) / 2
	first, err := Finish(ctx, db, outs[:mid])
	if err != nil {
		return first, err
	}
	rest, err := Finish(ctx, db, outs[mid:])
	return append(first, rest...), err
}

// outcomeLockWait bounds how long an outcome statement waits for a row a workflow's release or
// cancellation locks (SQLSTATE 55P03 past it).
const outcomeLockWait = "100ms"

// lockNotAvailable reports whether err is PostgreSQL's lock_not_available (55P03): a lock wait
// ran past its bound.
func lockNotAvailable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

func finishQuery(outs []Outcome) (string, []any, error) {
	n := len(outs)
	if allCompletions(outs) {
		ids, tokens, outputs := make([]int64, n), make([]int64, n), make([]*string, n)
		for i := range outs {
			ids[i], tokens[i] = outs[i].ID, outs[i].Token
			outputs[i] = cleanOutput(outs[i].Output)
		}
		return completeSQL, []any{int8Array(ids), int8Array(tokens), outputs}, nil
	}
	ids, tokens, states := make([]int64, n), make([]int64, n), make([]string, n)
	delays, giveBack := make([]int64, n), make([]bool, n)
	errs, revokes, outputs := make([]*string, n), make([]*string, n), make([]*string, n)
	for i := range outs {
		o := &outs[i]
		ids[i], tokens[i], states[i], delays[i], giveBack[i] = o.ID, o.Token, o.State, millis(o.RunIn), o.ReturnAttempt
		var err error
		if errs[i], err = o.encodeError(); err != nil {
			return "", nil, err
		}
		if o.Revoke != nil {
			r := clean.Text(*o.Revoke, MaxReasonBytes)
			revokes[i] = &r
		}
		outputs[i] = cleanOutput(o.Output)
	}
	return finishSQL, []any{int8Array(ids), int8Array(tokens), textArray(states), int8Array(delays), giveBack, errs, revokes, outputs}, nil
}

// allCompletions reports whether every outcome of outs completes its job and does nothing else
// (no error, no revocation, no attempt given back): what almost every batch is.
func allCompletions(outs []Outcome) bool {
	for i := range outs {
		o := &outs[i]
		if o.State != StateCompleted || o.ReturnAttempt || o.Error != nil || o.Revoke != nil {
			return false
		}
	}
	return true
}

// cleanOutput is the text of an outcome's output as written: nil for none, a note of why for
// JSON that is not valid.
func cleanOutput(output []byte) *string {
	if output == nil {
		return nil
	}
	b, err := CleanJSON(output)
	if err != nil {
		b = invalidOutput(err)
	}
	out := string(b)
	return &out
}

// int8Array and textArray are slices sent as bigint[] and text[] parameters whose elements pgx
// reads in place: a []int64 or []string is encoded through an interface holding a copy of each
// element, one allocation per element (per job of an outcome batch).
//
// pgx finds their binary encoding (pgtype.ArrayGetter) only when it knows the parameter's type
// from the statement's description, in the exec modes that prepare or describe it. Under
// QueryExecModeExec and QueryExecModeSimpleProtocol, what PgBouncer in transaction mode needs,
// it knows none and encodes every value in text for an unknown type, which it can do only for
// the types it has registered: for these it asks TextValue, an array literal built in one
// buffer. The statement casts each parameter ($1::bigint[]), so the server reads the literal as
// the type the described modes send.
type (
	int8Array []int64
	textArray []string
	int8Elem  int64
	textElem  string
)

func (a int8Array) Dimensions() []pgtype.ArrayDimension { return flatDimensions(len(a), a == nil) }
func (a int8Array) Index(i int) any                     { return (*int8Elem)(&a[i]) }
func (a int8Array) IndexType() any                      { return new(int8Elem) }
func (a textArray) Dimensions() []pgtype.ArrayDimension { return flatDimensions(len(a), a == nil) }
func (a textArray) Index(i int) any                     { return (*textElem)(&a[i]) }
func (a textArray) IndexType() any                      { return new(textElem) }

// TextValue implements pgtype.TextValuer: the array literal of a, {1,-2,3}; NULL for nil.
func (a int8Array) TextValue() (pgtype.Text, error) {
	if a == nil {
		return pgtype.Text{}, nil
	}
	b := make([]byte, 0, 2+len(a)*8)
	b = append(b, '{')
	for i, v := range a {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, v, 10)
	}
	return pgtype.Text{String: string(append(b, '}')), Valid: true}, nil
}

// TextValue implements pgtype.TextValuer: the array literal of a, every element quoted with its
// double quotes and backslashes escaped, {"completed","a\"b"}; NULL for nil.
func (a textArray) TextValue() (pgtype.Text, error) {
	if a == nil {
		return pgtype.Text{}, nil
	}
	n := 2
	for _, s := range a {
		n += len(s) + 3
	}
	b := make([]byte, 0, n)
	b = append(b, '{')
	for i, s := range a {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		for j := 0; j < len(s); j++ {
			if s[j] == '"' || s[j] == '\\' {
				b = append(b, '\\')
			}
			b = append(b, s[j])
		}
		b = append(b, '"')
	}
	return pgtype.Text{String: string(append(b, '}')), Valid: true}, nil
}

func (e *int8Elem) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*e), Valid: true}, nil
}
func (e *textElem) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*e), Valid: true}, nil
}

// flatDimensions are the dimensions of a one-dimensional array of n elements; none (NULL) for
// a nil slice.
func flatDimensions(n int, null bool) []pgtype.ArrayDimension {
	if null {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(n), LowerBound: 1}}
}

func scanWritten(rows pgx.Rows, n int) ([]Written, error) {
	defer rows.Close()
	written := make([]Written, 0, n)
	var id int64
	var state internedText
	var notified *bool
	var frees bool
	dest := []any{&id, &state, &notified, &frees} // given to Scan once: it escapes
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return nil, fmt.Errorf("finish jobs: %w", err)
		}
		written = append(written, Written{ID: id, State: state.s, Frees: frees})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("finish jobs: %w", err)
	}
	return written, nil
}

const finishSQL = `
		WITH bounded AS (
			-- The rows a workflow's release and cancellation lock (see bound_outcome_lock_wait
			-- in sql/020_workflows.sql) are waited for at most this long.
			SELECT pg_catalog.set_config('leash.outcome_lock_wait', '` + outcomeLockWait + `', true) AS v
		), u AS (
			-- The token is checked here, on the latest row version. A row another transaction
			-- holds (an operator's UPDATE, a report's FOR SHARE) is skipped rather than waited
			-- for: the caller tries that one outcome again later, and the others are written now.
			SELECT j.id, i.state, i.delay_ms, i.give_back, i.err, i.revoke, i.output
			FROM leash.jobs j
			JOIN unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[], $5::boolean[], $6::jsonb[], $7::text[], $8::jsonb[])
				AS i(id, token, state, delay_ms, give_back, err, revoke, output) ON j.id = i.id AND j.lease_token = i.token
			WHERE (SELECT v FROM bounded) IS NOT NULL
			ORDER BY j.id
			FOR NO KEY UPDATE OF j SKIP LOCKED
		)
		UPDATE leash.jobs j
		SET state = u.state,
		    attempt = CASE WHEN u.give_back THEN greatest(j.attempt - 1, 0) ELSE j.attempt END,
		    run_at = CASE WHEN u.state IN ('available', 'retryable') THEN now() + u.delay_ms * interval '1 millisecond' ELSE j.run_at END,
		    finished_at = CASE WHEN u.state IN ('completed', 'failed', 'cancelled') THEN now() END,
		    errors = CASE WHEN u.err IS NULL THEN j.errors ELSE ` + errorsHistorySQL + ` || jsonb_build_array(jsonb_build_object('at', now()) || u.err) END,
		    last_error = coalesce(u.err->>'error', j.last_error),
		    revoked_at = CASE WHEN u.revoke IS NOT NULL THEN coalesce(j.revoked_at, now()) ELSE j.revoked_at END,
		    revoke_reason = CASE WHEN u.revoke IS NOT NULL AND j.revoked_at IS NULL THEN u.revoke ELSE j.revoke_reason END,
		    output = CASE WHEN u.give_back AND u.output IS NULL THEN j.output ELSE u.output END,
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		FROM u
		WHERE j.id = u.id
		RETURNING j.id, j.state,
		    CASE WHEN j.state IN ('available', 'retryable') AND j.run_at <= now() THEN leash.notify_available(j.queue) END,
		    j.workflow_id IS NOT NULL AND j.state IN ('completed', 'failed', 'cancelled')`

// completeSQL is finishSQL for a batch of completions alone (allCompletions): the same fence,
// locks, lock wait and rows returned, with the columns a completion leaves as they are left out
// of its SET list and its three arrays in place of eight. Every trigger on the columns it sets
// fires as for finishSQL; the one on revoked_at alone does not, and its WHEN is false for a job
// that is not running. What it saves is per statement (a smaller plan, fewer triggers' WHENs
// read) and per row (three arrays unnested, seven columns assigned, not thirteen).
const completeSQL = `
		WITH bounded AS (
			SELECT pg_catalog.set_config('leash.outcome_lock_wait', '` + outcomeLockWait + `', true) AS v
		), u AS (
			SELECT j.id, i.output
			FROM leash.jobs j
			JOIN unnest($1::bigint[], $2::bigint[], $3::jsonb[]) AS i(id, token, output)
				ON j.id = i.id AND j.lease_token = i.token
			WHERE (SELECT v FROM bounded) IS NOT NULL
			ORDER BY j.id
			FOR NO KEY UPDATE OF j SKIP LOCKED
		)
		UPDATE leash.jobs j
		SET state = 'completed', finished_at = now(), output = u.output,
		    lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
		FROM u
		WHERE j.id = u.id
		RETURNING j.id, j.state,
		    CASE WHEN j.state IN ('available', 'retryable') AND j.run_at <= now() THEN leash.notify_available(j.queue) END,
		    j.workflow_id IS NOT NULL AND j.state IN ('completed', 'failed', 'cancelled')`

// errorsHistorySQL is j.errors, the history an entry is appended to (history || [entry]), unless
// its stored size passes 1 MiB: then a note of the entries dropped replaces it. Any SQL
// client may write the column, and jsonb refuses an array past 256 MiB: appending to such a
// history failed the statement, and with it every outcome of its batch or every lease of a
// rescue. The bound is on the stored (perhaps compressed) size, which costs nothing to read; at
// most 255 times smaller than the history itself, it keeps every history that is kept under the
// limit. leash's own entries are bounded (MaxErrorBytes, MaxStackBytes), so only histories of
// thousands of attempts, or a client's, are ever dropped.
const errorsHistorySQL = `CASE WHEN pg_column_size(j.errors) <= ` + maxHistoryBytesSQL + ` THEN j.errors
		        ELSE jsonb_build_array(jsonb_build_object('at', now(), 'error',
		            'earlier errors dropped: the history took ' || pg_column_size(j.errors) || ' bytes')) END`

const maxHistoryBytesSQL = "1048576"

// invalidOutput stands in for an output that is not valid JSON: the outcome is written, with a
// note of why the output is not.
func invalidOutput(err error) []byte {
	b, _ := json.Marshal(map[string]string{"invalid_output": clean.Text(err.Error(), 512)})
	return b
}

// StillHeld returns which of the jobs ids[i] still carry tokens[i] (read without a lock): an
// outcome Finish did not write for such a job met a locked row, not a lost lease.
func StillHeld(ctx context.Context, db DBTX, ids, tokens []int64) (map[int64]bool, error) {
	rows, err := db.Query(ctx, stillHeldSQL, int8Array(ids), int8Array(tokens))
	if err != nil {
		return nil, fmt.Errorf("read leases: %w", err)
	}
	defer rows.Close()
	out := make(map[int64]bool, len(ids))
	var id int64 // scanned into for every row: one allocation for the statement, not one per row
	for rows.Next() {
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("read leases: %w", err)
		}
		out[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read leases: %w", err)
	}
	return out, nil
}

// stillHeldSQL reads each lease's row through the primary key, as renewSQL does and for the same
// reason: a join of the table to the arrays may be planned, under statistics that count few
// running jobs, as a scan of the whole array for every running row. OFFSET 0 keeps both
// subqueries as written (neither is merged into a join the planner could reorder, nor the state
// folded into a constant that the running jobs' partial indexes match).
const stillHeldSQL = `
		SELECT h.id
		FROM (SELECT u.id, u.token, 'running'::text AS state
		      FROM unnest($1::bigint[], $2::bigint[]) AS u(id, token) OFFSET 0) AS u
		CROSS JOIN LATERAL (
			SELECT j.id FROM leash.jobs j
			WHERE j.id = u.id AND j.lease_token = u.token AND j.state = u.state
			OFFSET 0) AS h`

// ErrFenced means a fenced write found the lease gone: the job is no longer held under the
// token the caller has.
var ErrFenced = errors.New("lease token no longer holds")

// ErrRevokedRow means a fenced write found the job still held under the caller's token but
// revoked: nothing more may commit in its name.
var ErrRevokedRow = errors.New("job revoked")

// Fence locks the job row in tx FOR KEY SHARE and fails with ErrFenced unless it is still running
// under token, or with ErrRevokedRow when it was revoked, so that the caller's other writes in tx
// commit only under a live, unrevoked lease. The lock keeps every takeover off the row until tx
// ends, and lets renewals, revocations and outcome writes go on beside it: a long transaction
// keeps its lease, and a revocation neither waits for it nor loses to it, because Fence also
// stages a check that tx's commit makes again under a lock (leash.apply_fenced_writes): the
// commit fails with SQLSTATE LR001 (CommitRevokedCode) once the job was revoked, or LR002
// (CommitFencedCode) once the claim no longer holds it.
//
// Fence, CompleteTx, SetProgress and SetProgressTx run on the application's connections, with
// its settings: their SQL names every function and operator with its schema, so that no
// search_path can change what they compare. The caller's isolation level matters: under
// REPEATABLE READ or SERIALIZABLE, a row renewed (or revoked) after the transaction's snapshot
// was taken fails the lock, and the commit's check, with a serialization failure (SQLSTATE
// 40001), never with a stale success: such a transaction commits only if no renewal came
// between its snapshot and its commit.
func Fence(ctx context.Context, tx DBTX, id, token int64) error {
	return stageFenced(ctx, tx, "fence", id, token, `INSERT INTO leash.fenced_writes (job_id, token) SELECT $1, $2 FROM cur WHERE NOT cur.revoked`)
}

// CommitRevokedCode and CommitFencedCode are the SQLSTATEs a fenced transaction's commit fails
// with when the job was revoked, or the claim no longer holds it, since Fence, SetProgressTx or
// CompleteTx ran in it.
const (
	CommitRevokedCode = "LR001"
	CommitFencedCode  = "LR002"
)

// stageFenced locks the job's row FOR KEY SHARE under token and, unless it is revoked, runs
// stage (a statement reading cur) to stage a write for tx's commit.
func stageFenced(ctx context.Context, tx DBTX, what string, id, token int64, stage string, args ...any) error {
	var revoked bool
	err := tx.QueryRow(ctx, `
		WITH cur AS (
			SELECT id, revoked_at IS NOT NULL AS revoked FROM leash.jobs
			WHERE id OPERATOR(pg_catalog.=) $1 AND lease_token OPERATOR(pg_catalog.=) $2 AND state OPERATOR(pg_catalog.=) 'running'
			FOR KEY SHARE
		), staged AS (`+stage+`)
		SELECT revoked FROM cur`, append([]any{id, token}, args...)...).Scan(&revoked)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrFenced
	}
	if err != nil {
		return fmt.Errorf("%s job %d: %w", what, id, err)
	}
	if revoked {
		return ErrRevokedRow
	}
	return nil
}

// CompleteTx completes the job when tx commits, guarded by its token; ErrFenced when the lease
// is gone, ErrRevokedRow when the job was revoked (a revocation committed before the completion
// wins). The completion is staged, like Fence's check, and written by tx's commit, which fails
// if the job was revoked or lost meanwhile; until then the row stays running, so that renewals
// and revocations go on.
func CompleteTx(ctx context.Context, tx DBTX, id, token int64, output []byte) error {
	var out *string
	if output != nil {
		b, err := CleanJSON(output)
		if err != nil {
			return fmt.Errorf("complete job %d: output: %w", id, err)
		}
		o := string(b)
		out = &o
	}
	return stageFenced(ctx, tx, "complete", id, token,
		`INSERT INTO leash.fenced_writes (job_id, token, complete, output) SELECT $1, $2, true, $3::pg_catalog.jsonb FROM cur WHERE NOT cur.revoked`, out)
}

// ErrRowBusy means a write could not lock the job's row in time: another transaction holds it
// (often the job's own fenced transaction: write through it instead).
var ErrRowBusy = errors.New("job row locked by another transaction")

// SetProgress stores a checkpoint on the job, guarded by its token; ErrFenced when the lease
// is gone. It never waits on the row's lock: while another transaction holds it, it retries
// briefly and then fails with ErrRowBusy, so that a checkpoint written beside the job's own
// open fenced transaction fails instead of waiting for it forever.
func SetProgress(ctx context.Context, db DBTX, id, token int64, progress []byte) error {
	progress, err := CleanJSON(progress)
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", id, err)
	}
	wait := 5 * time.Millisecond
	deadline := time.Now().Add(2 * time.Second)
	for {
		var state string
		err := db.QueryRow(ctx, `
			WITH cur AS (
				SELECT id, lease_token, state FROM leash.jobs WHERE id OPERATOR(pg_catalog.=) $1 FOR NO KEY UPDATE SKIP LOCKED
			), upd AS (
				UPDATE leash.jobs j SET progress = $3 FROM cur
				WHERE j.id OPERATOR(pg_catalog.=) cur.id AND cur.lease_token OPERATOR(pg_catalog.=) $2
				  AND cur.state OPERATOR(pg_catalog.=) 'running'
				RETURNING j.id
			)
			SELECT CASE WHEN EXISTS (SELECT FROM upd) THEN 'written'
			            WHEN EXISTS (SELECT FROM cur) THEN 'fenced'
			            ELSE 'busy' END`, id, token, string(progress)).Scan(&state)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "40001" && time.Now().Before(deadline) {
			// The application's default isolation is above read committed and a renewal changed
			// the row after this statement's snapshot: a new statement has a new snapshot.
			continue
		}
		if err != nil {
			return fmt.Errorf("set progress of job %d: %w", id, err)
		}
		switch state {
		case "written":
			return nil
		case "fenced":
			return ErrFenced
		}
		// Locked, or no such row: tell them apart without a lock.
		var held bool
		err = db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM leash.jobs
			WHERE id OPERATOR(pg_catalog.=) $1 AND lease_token OPERATOR(pg_catalog.=) $2 AND state OPERATOR(pg_catalog.=) 'running')`,
			id, token).Scan(&held)
		if err != nil {
			return fmt.Errorf("set progress of job %d: %w", id, err)
		}
		if !held {
			return ErrFenced
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("set progress of job %d: %w", id, ErrRowBusy)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("set progress of job %d: %w", id, context.Cause(ctx))
		case <-time.After(wait):
		}
		wait = min(wait*2, 200*time.Millisecond)
	}
}

// SetProgressTx stores a checkpoint on the job when tx commits, guarded by its token; ErrFenced
// when the lease is gone. Like CompleteTx it is staged and written by tx's commit (which fails if
// the claim was revoked or lost meanwhile), so tx holds the row no more firmly than Fence does.
func SetProgressTx(ctx context.Context, tx DBTX, id, token int64, progress []byte) error {
	progress, err := CleanJSON(progress)
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", id, err)
	}
	tag, err := tx.Exec(ctx, `
		WITH cur AS (
			SELECT id FROM leash.jobs
			WHERE id OPERATOR(pg_catalog.=) $1 AND lease_token OPERATOR(pg_catalog.=) $2 AND state OPERATOR(pg_catalog.=) 'running'
			FOR KEY SHARE
		)
		INSERT INTO leash.fenced_writes (job_id, token, progress) SELECT $1, $2, $3::pg_catalog.jsonb FROM cur`,
		id, token, string(progress))
	if err != nil {
		return fmt.Errorf("set progress of job %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return ErrFenced
	}
	return nil
}
