package store_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// insertRow inserts a job with the given column values from SQL, as any client may, and returns
// its id.
func insertRow(t *testing.T, db *pgxpool.Pool, queue, cols, vals string) int64 {
	t.Helper()
	var id int64
	q := fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind%s) VALUES ($1, 'hostile'%s) RETURNING id`, cols, vals)
	if err := db.QueryRow(context.Background(), q, queue).Scan(&id); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return id
}

// oldRow inserts a row that the checks of sql/013 refuse, as rows written before that migration
// may be: the check is dropped for the insert and added back NOT VALID, as the migration adds it.
func oldRow(t *testing.T, db *pgxpool.Pool, queue, cols, vals string) int64 {
	t.Helper()
	ctx := context.Background()
	if _, err := db.Exec(ctx, `ALTER TABLE leash.jobs DROP CONSTRAINT jobs_attempt_room_check`); err != nil {
		t.Fatal(err)
	}
	id := insertRow(t, db, queue, cols, vals)
	if _, err := db.Exec(ctx, `ALTER TABLE leash.jobs ADD CONSTRAINT jobs_attempt_room_check
		CHECK (attempt < 2147483647 OR state NOT IN ('available', 'retryable')) NOT VALID`); err != nil {
		t.Fatal(err)
	}
	return id
}

// expire makes every running job's lease expire on the database clock.
func expire(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second' WHERE state = 'running'`); err != nil {
		t.Fatal(err)
	}
}

// A row no claim can lease (an attempt counter at the largest integer, written before the table
// refused it) is set aside, failed with an error naming why, by every form of the claim: it
// used to make each claim of its queue fail with "integer out of range", from the front forever,
// and with it every claim of a worker serving that queue with others.
func TestClaimSetsAsideRowsItCannotLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	if _, err := db.Exec(ctx, `INSERT INTO leash.queues (name, max_running) VALUES ('q capped', 10)`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		claim func(queue string) ([]store.ClaimedJob, error)
	}{
		{"one queue", func(q string) ([]store.ClaimedJob, error) {
			return ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{q}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		}},
		{"many queues", func(q string) ([]store.ClaimedJob, error) {
			return ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{q, "other"}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		}},
		{"past a cursor", func(q string) ([]store.ClaimedJob, error) {
			return ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{q}, Limit: 10, WorkerID: "w", Lease: time.Minute,
				After: &store.ClaimCursor{Priority: -32768, RunAt: time.Unix(0, 0), ID: 0}, Lag: time.Second})
		}},
		{"capped", func(q string) ([]store.ClaimedJob, error) {
			return store.ClaimCapped(ctx, db, store.ClaimParams{Queues: []string{q}, Limit: 10, WorkerID: "w", Lease: time.Minute})
		}},
		{"with outcomes", func(q string) ([]store.ClaimedJob, error) {
			_, jobs, err := ensureAndFinishAndClaim(ctx, db, nil, store.ClaimParams{Queues: []string{q}, Limit: 10, WorkerID: "w", Lease: time.Minute})
			return jobs, err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := "q " + tc.name
			stuck := oldRow(t, db, q, ", attempt, max_attempts, run_at", ", 2147483647, 2147483647, now() - interval '1 hour'")
			fine := insertRow(t, db, q, "", "")
			jobs, err := tc.claim(q)
			if err != nil {
				t.Fatalf("claim with an unclaimable row at the front: %v", err)
			}
			var leased, setAside []int64
			for _, j := range jobs {
				if j.SetAside {
					setAside = append(setAside, j.ID)
				} else {
					leased = append(leased, j.ID)
				}
			}
			if len(leased) != 1 || leased[0] != fine || len(setAside) != 1 || setAside[0] != stuck {
				t.Fatalf("leased %v, set aside %v; want [%d], [%d]", leased, setAside, fine, stuck)
			}
			var state, lastError string
			var entries int
			if err := db.QueryRow(ctx, `SELECT state, last_error, jsonb_array_length(errors) FROM leash.jobs WHERE id = $1`, stuck).
				Scan(&state, &lastError, &entries); err != nil {
				t.Fatal(err)
			}
			if state != "failed" || !strings.Contains(lastError, "attempt counter (2147483647) has no room") || entries != 1 {
				t.Fatalf("set-aside row: state %s, last_error %q, %d errors entries", state, lastError, entries)
			}
		})
	}
}

// The table refuses a queued row whose next claim would overflow its attempt counter; a job
// claimed at the last count it can take runs, and every way its attempt ends is writable (it has
// used up any max_attempts, so it never goes back to the queue at that count).
func TestAttemptCounterAtItsLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	_, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, attempt, max_attempts) VALUES ('noop', 2147483647, 2147483647)`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "23514" || pe.ConstraintName != "jobs_attempt_room_check" {
		t.Fatalf("queued row at the counter's limit: %v, want a check violation", err)
	}
	for _, out := range []store.Outcome{
		{State: store.StateAvailable, ReturnAttempt: true}, // a hand-back
		{State: store.StateFailed, Error: &store.AttemptError{Attempt: 2147483647, Error: "boom"}},
		{State: store.StateCancelled},
	} {
		q := "limit " + out.State
		id := insertRow(t, db, q, ", attempt, max_attempts", ", 2147483646, 2147483647")
		jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{q}, Limit: 1, WorkerID: "w", Lease: time.Minute})
		if err != nil || len(jobs) != 1 || jobs[0].SetAside || jobs[0].Attempt != 2147483647 {
			t.Fatalf("claim at the last count: %+v, %v", jobs, err)
		}
		if _, err := store.Renew(ctx, db, store.RenewParams{IDs: []int64{id}, Tokens: []int64{jobs[0].Token}, Lease: time.Minute}); err != nil {
			t.Fatalf("renew: %v", err)
		}
		out.ID, out.Token = id, jobs[0].Token
		if ws, err := store.Finish(ctx, db, []store.Outcome{out}); err != nil || len(ws) != 1 {
			t.Fatalf("finish %s: %v, %v", out.State, ws, err)
		}
	}
	// Rescued at the limit: failed, attempts used up.
	id := insertRow(t, db, "limit rescue", ", attempt, max_attempts", ", 2147483646, 2147483647")
	if _, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"limit rescue"}, Limit: 1, WorkerID: "w", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	expire(t, db)
	rescued, err := store.Rescue(ctx, db, 10)
	if err != nil || len(rescued) != 1 || rescued[0].ID != id || rescued[0].State != store.StateFailed {
		t.Fatalf("rescue at the limit: %+v, %v", rescued, err)
	}
}

// A claim past the cursor starts a lag before the last job claimed, which never reaches before
// the earliest timestamp PostgreSQL holds: a job any client scheduled there made the next claim
// fail on its parameter.
func TestClaimPastCursorAtTheEarliestTimestamp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	insertRow(t, db, "early", ", run_at", ", '4714-11-24 00:00:00.05+00 BC'")
	first, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"early"}, Limit: 1, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(first) != 1 {
		t.Fatalf("claim: %v, %v", first, err)
	}
	next := insertRow(t, db, "early", "", "")
	got, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"early"}, Limit: 1, WorkerID: "w", Lease: time.Minute,
		After: store.LastClaimed(first), Lag: 100 * time.Millisecond})
	if err != nil || len(got) != 1 || got[0].ID != next {
		t.Fatalf("claim past a cursor at the earliest timestamp: %v, %v", got, err)
	}
}

// The claim reads a job's timeout in the check's own arithmetic (interval comparison: 30-day
// months, 24-hour days), for any interval a client can write: the limit a job gets is exactly
// the one the check let in, rounded up to the millisecond. Reading it with extract(epoch ...)
// (365.25-day years) turned '-1 year 361 days', one day to the check, into minus 102 hours: no
// limit at all, and the kind's default skipped.
func TestTimeoutReadAsTheCheckSeesIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	const day = 24 * time.Hour
	for _, tc := range []struct {
		interval string
		want     time.Duration // 0: the check refuses it
	}{
		{"1 millisecond", time.Millisecond},
		{"1.001 milliseconds", 2 * time.Millisecond},
		{"0.999 milliseconds", 0},
		{"100 days", 100 * day},
		{"100 days 1 microsecond", 0},
		{"-1 year 361 days", day},
		{"1 year -359 days", day},
		{"1 year -360 days", 0},
		{"-1 year 361 days -23:59:59.95", 50 * time.Millisecond},
		{"1 year -359 days -23:59:59.95", 50 * time.Millisecond},
		{"100 years -36000 days 0.05 seconds", 50 * time.Millisecond},
		{"5000000 years -1799999999 days", day},
		{"-5000000 years 1800000000 days 12:00", 12 * time.Hour},
		{"1 mon -29 days -23:59:59.999", time.Millisecond},
		{"3 mons 10 days", 100 * day},
		{"-1 mon 31 days", day},
		{"1 day -86399.999 seconds", time.Millisecond},
		{"2400:00:00", 100 * day},
		{"-2 years 820 days", 100 * day},
		{"178000000 years", 0},
		{"-178000000 years", 0},
		{"1 day -2562047788:00:54.775807", 0},
		{"-1 year 2562047788:00:54.775807", 0},
	} {
		t.Run(tc.interval, func(t *testing.T) {
			var id int64
			err := db.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, timeout) VALUES ($1, 'hostile', $2::interval) RETURNING id`,
				tc.interval, tc.interval).Scan(&id)
			if tc.want == 0 {
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != "23514" {
					t.Fatalf("insert: %v, want a check violation", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{tc.interval}, Limit: 1, WorkerID: "w", Lease: time.Minute})
			if err != nil || len(jobs) != 1 {
				t.Fatalf("claim: %v, %v", jobs, err)
			}
			if jobs[0].Timeout != tc.want {
				t.Fatalf("timeout read as %s, want %s", jobs[0].Timeout, tc.want)
			}
			// The same, as the check compares: the limit covers the interval by less than 1ms.
			var agree bool
			if err := db.QueryRow(ctx, `SELECT timeout <= $2 * interval '1 millisecond' AND timeout > ($2 - 1) * interval '1 millisecond'
				FROM leash.jobs WHERE id = $1`, id, tc.want.Milliseconds()).Scan(&agree); err != nil || !agree {
				t.Fatalf("interval comparison disagrees with %s: %v", tc.want, err)
			}
		})
	}
}

// Schedules read their timeout the same way.
func TestScheduleTimeoutReadAsTheCheckSeesIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind, timeout) VALUES ('s', '@hourly', 'noop', '-1 year 361 days')`); err != nil {
		t.Fatal(err)
	}
	rows, err := store.ListSchedules(ctx, db)
	if err != nil || len(rows) != 1 {
		t.Fatalf("list schedules: %v, %v", rows, err)
	}
	if rows[0].Timeout != 24*time.Hour {
		t.Fatalf("schedule timeout read as %s, want 24h", rows[0].Timeout)
	}
}

// Durations go to the database in milliseconds rounded up: a positive one never becomes 0, which
// the statements read as none. UniqueFinishedWithin under 1ms turned the check off and
// Snooze(500µs) woke at once; an insert and a COPY rounded a timeout differently.
func TestSubMillisecondDurationsRoundUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	tx, err := db.Begin(ctx) // one transaction: now() stands still, so the bounds are exact
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// A finished job within 500µs (the same now()) holds its key.
	first, err := store.Insert(ctx, tx, store.InsertParams{Queue: "sub", Kind: "k", MaxAttempts: 1, UniqueKey: "key"})
	if err != nil {
		t.Fatal(err)
	}
	jobs, err := ensureAndClaim(ctx, tx, store.ClaimParams{Queues: []string{"sub"}, Limit: 1, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim: %v, %v", jobs, err)
	}
	if _, err := store.Finish(ctx, tx, []store.Outcome{{ID: first, Token: jobs[0].Token, State: store.StateCompleted}}); err != nil {
		t.Fatal(err)
	}
	id, dup, err := store.InsertUnique(ctx, tx, store.InsertParams{Queue: "sub2", Kind: "k", MaxAttempts: 1, UniqueKey: "key",
		UniqueWithin: 500 * time.Microsecond})
	if err != nil || !dup || id != first {
		t.Fatalf("insert within 500µs of the key's finish: id %d, duplicate %v, %v; want job %d", id, dup, err, first)
	}
	// A delay and a snooze of 500µs wait 1ms.
	delayed, err := store.Insert(ctx, tx, store.InsertParams{Queue: "sub3", Kind: "k", MaxAttempts: 1, Delay: 500 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	snoozed, err := store.Insert(ctx, tx, store.InsertParams{Queue: "sub4", Kind: "k", MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	jobs, err = ensureAndClaim(ctx, tx, store.ClaimParams{Queues: []string{"sub4"}, Limit: 1, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim: %v, %v", jobs, err)
	}
	if _, err := store.Finish(ctx, tx, []store.Outcome{{ID: snoozed, Token: jobs[0].Token, State: store.StateAvailable,
		RunIn: 500 * time.Microsecond, ReturnAttempt: true}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []int64{delayed, snoozed} {
		var wait time.Duration
		if err := tx.QueryRow(ctx, `SELECT run_at - now() FROM leash.jobs WHERE id = $1`, id).Scan(&wait); err != nil {
			t.Fatal(err)
		}
		if wait != time.Millisecond {
			t.Fatalf("job %d waits %s after asking for 500µs, want 1ms", id, wait)
		}
	}
	// A timeout of 1.5ms is 2ms, inserted alone or by COPY.
	one, err := store.Insert(ctx, tx, store.InsertParams{Queue: "t", Kind: "k", MaxAttempts: 1, Timeout: 1500 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.InsertMany(ctx, db, []store.InsertParams{{Queue: "copied", Kind: "k", MaxAttempts: 1, Timeout: 1500 * time.Microsecond}}); err != nil {
		t.Fatal(err)
	}
	var single, copied time.Duration
	if err := tx.QueryRow(ctx, `SELECT timeout FROM leash.jobs WHERE id = $1`, one).Scan(&single); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(ctx, `SELECT timeout FROM leash.jobs WHERE queue = 'copied'`).Scan(&copied); err != nil {
		t.Fatal(err)
	}
	if single != 2*time.Millisecond || copied != 2*time.Millisecond {
		t.Fatalf("timeout of 1.5ms stored as %s (insert) and %s (COPY), want 2ms", single, copied)
	}
}

// An errors history too large to take another entry (any client may write one: jsonb refuses an
// array past 256 MiB) is replaced by a note when an entry is appended, so that neither the
// outcome's batch nor a rescue of many leases fails on it. Both used to fail the whole statement.
func TestHugeHistoriesDoNotFailWrites(t *testing.T) {
	if testing.Short() {
		t.Skip("writes a history of 256 MiB")
	}
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	// 55 bytes short of the limit: no entry fits.
	const huge = `jsonb_build_array(repeat('x', 268435400))`
	// One job holds a history at jsonb's limit; it runs with an expired lease beside two others.
	full := insertRow(t, db, "big", ", errors", ", "+huge)
	insertRow(t, db, "big", "", "")
	insertRow(t, db, "big", "", "")
	jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"big"}, Limit: 3, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("claim: %v, %v", jobs, err)
	}
	expire(t, db)
	rescued, err := store.Rescue(ctx, db, 10)
	if err != nil || len(rescued) != 3 {
		t.Fatalf("rescue beside a huge history: %d rescued, %v", len(rescued), err)
	}
	var note string
	var entries int
	if err := db.QueryRow(ctx, `SELECT errors->0->>'error', jsonb_array_length(errors) FROM leash.jobs WHERE id = $1`, full).
		Scan(&note, &entries); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(note, "earlier errors dropped") || entries != 2 {
		t.Fatalf("history after the rescue: first entry %q, %d entries", note, entries)
	}
	// The outcome of a claim beside the same history again.
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET errors = `+huge+` WHERE id = $1`, full); err != nil {
		t.Fatal(err)
	}
	jobs, err = ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"big"}, Limit: 3, WorkerID: "w", Lease: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("claim: %v, %v", jobs, err)
	}
	outs := make([]store.Outcome, len(jobs))
	for i, j := range jobs {
		outs[i] = store.Outcome{ID: j.ID, Token: j.Token, State: store.StateFailed, Error: &store.AttemptError{Attempt: j.Attempt, Error: "boom"}}
	}
	ws, err := store.Finish(ctx, db, outs)
	if err != nil || len(ws) != 3 {
		t.Fatalf("outcomes beside a huge history: %v, %v", ws, err)
	}
}

// The minute rollup skips the pickup of rows whose run_at or created_at is infinite, and reads one
// from a run_at at the earliest timestamp as the longest Duration: subtracting infinity failed
// the statement, and with it every minute's row.
func TestSampleMinutesBesideInfiniteTimestamps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	insertStatsRows(t, db, []statsRow{
		{"completed", "infinity", "2026-03-01T09:10:00Z", "2026-03-01T09:10:00.1Z", "2026-03-01T09:10:01Z"},
		{"completed", "2026-03-01T09:10:00Z", "-infinity", "2026-03-01T09:10:00.1Z", "2026-03-01T09:10:01Z"},
		{"completed", "4714-11-24T00:00:00Z", "4714-11-24T00:00:00Z", "2026-03-01T09:20:00.1Z", "2026-03-01T09:20:01Z"},
	})
	// created_at '4714-11-24T00:00:00Z' above is year 4714 AD; the earliest timestamp is BC.
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET created_at = '4714-11-24 00:00:00+00 BC', run_at = '4714-11-24 00:00:00+00 BC'
		WHERE attempted_at = '2026-03-01T09:20:00.1Z'`); err != nil {
		t.Fatal(err)
	}
	if _, err := store.SampleMinutes(ctx, db, store.SampleParams{Now: ts("2026-03-01T10:00:07Z")}); err != nil {
		t.Fatalf("sample minutes beside infinite timestamps: %v", err)
	}
	got, err := store.ReadMinuteStats(ctx, db, store.ReadStatsParams{Now: ts("2026-03-01T10:00:30Z")})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range got {
		switch m.Minute.Format("15:04") {
		case "09:10":
			if m.Completed != 2 || m.Started != 2 || m.PickupP50 != nil {
				t.Fatalf("09:10: %+v, want 2 completed and started, no pickup", m)
			}
		case "09:20":
			if m.PickupP50 == nil || *m.PickupP50 != time.Duration(math.MaxInt64) {
				t.Fatalf("09:20: pickup %v, want the longest Duration", m.PickupP50)
			}
		}
	}
}
