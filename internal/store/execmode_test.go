package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// execModes are every pgx query exec mode: behind PgBouncer in transaction mode applications
// set exec or simple_protocol, where pgx knows no parameter's type and sends every value as
// text (exec: extended protocol, parameters of unknown type; simple_protocol: the values
// interpolated into the statement's text).
var execModes = []string{"cache_statement", "cache_describe", "describe_exec", "exec", "simple_protocol"}

// poolInMode is a pool on url whose connections run every statement in the pgx query exec
// mode given.
func poolInMode(t *testing.T, url, mode string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url + "&default_query_exec_mode=" + mode)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.ReplaceAll(cfg.ConnConfig.DefaultQueryExecMode.String(), " ", "_"); got != mode {
		t.Fatalf("pool in mode %s: got %s", mode, got)
	}
	db, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return db
}

// Claims (of one queue, of several, after a cursor, of a capped queue, by id, pipelined with
// outcomes) and outcome batches read and write the same values in every pgx query exec mode:
// the arrays an outcome batch sends and the texts a claim scans in place have an encoding and a
// decoding in text as well as in binary. (Under exec and simple_protocol the outcome arrays had
// none, and no outcome was ever written behind PgBouncer.)
func TestFinishUnderExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range execModes {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url := pgtest.URL(t)
			db0 := pgtest.PoolFor(t, url)
			if err := store.EnsureQueues(ctx, db0, []string{"default", "other"}); err != nil {
				t.Fatal(err)
			}
			exec(t, db0, `INSERT INTO leash.queues (name, max_running) VALUES ('capped', 10)`)
			ins := func(queue, kind, payload string) int64 {
				t.Helper()
				id, err := store.Insert(ctx, db0, jp(store.InsertParams{Queue: queue, Kind: kind, Payload: []byte(payload)}))
				if err != nil {
					t.Fatal(err)
				}
				return id
			}
			want := map[int64][3]string{} // id: queue, kind, payload (each its own)
			for i, q := range []string{"default", "default", "default", "default", "other", "other", "capped"} {
				kind := []string{"send", "send \"mail\"", `back\slash`, "ünïcode, {braces}"}[i%4]
				payload := fmt.Sprintf(`{"n": %d}`, i)
				want[ins(q, kind, payload)] = [3]string{q, kind, payload}
			}
			byID := ins("other", "byid", `{}`)
			want[byID] = [3]string{"other", "byid", `{}`}

			db := poolInMode(t, url, mode)
			var claimed []store.ClaimedJob
			check := func(what string, jobs []store.ClaimedJob, err error, n int) {
				t.Helper()
				if err != nil || len(jobs) != n {
					t.Fatalf("%s: %d jobs, %v; want %d", what, len(jobs), err, n)
				}
				for _, j := range jobs {
					w, ok := want[j.ID]
					if !ok || j.Queue != w[0] || j.Kind != w[1] || j.Token == 0 || j.Attempt != 1 ||
						j.RunAt.IsZero() || j.CreatedAt.IsZero() || j.AttemptedAt.IsZero() {
						t.Fatalf("%s: claimed %+v; want queue %q, kind %q, attempt 1, a token and timestamps", what, j, w[0], w[1])
					}
					var got, wantPayload any
					if err := json.Unmarshal(j.Payload, &got); err != nil {
						t.Fatalf("%s: payload %q: %v", what, j.Payload, err)
					}
					_ = json.Unmarshal([]byte(w[2]), &wantPayload)
					if !reflect.DeepEqual(got, wantPayload) {
						t.Fatalf("%s: job %d has payload %s; want %s", what, j.ID, j.Payload, w[2])
					}
				}
				claimed = append(claimed, jobs...)
			}
			params := func(limit int, queues ...string) store.ClaimParams {
				return store.ClaimParams{Queues: queues, Limit: limit, WorkerID: "w", Lease: time.Minute}
			}
			jobs, err := store.Claim(ctx, db, params(2, "default"))
			check("claim of one queue", jobs, err, 2)
			p := params(1, "default")
			p.After = store.LastClaimed(jobs)
			jobs, err = store.Claim(ctx, db, p)
			check("claim after a cursor", jobs, err, 1)
			jobs, err = store.Claim(ctx, db, params(2, "default", "other"))
			check("claim of two queues", jobs, err, 2)
			jobs, err = store.ClaimCapped(ctx, db, params(5, "capped"))
			check("claim of a capped queue", jobs, err, 1)
			j, err := store.ClaimByID(ctx, db, byID, "w", time.Minute)
			check("claim by id", []store.ClaimedJob{j}, err, 1)

			reason := `stop "now", \please {x,y} NULL`
			outs := []store.Outcome{
				{ID: claimed[0].ID, Token: claimed[0].Token, State: store.StateCompleted, Output: []byte(`{"ok": true}`)},
				{ID: claimed[1].ID, Token: claimed[1].Token, State: store.StateRetryable, RunIn: time.Hour,
					Error: &store.AttemptError{Attempt: 1, Error: `it "broke"`}},
				{ID: claimed[2].ID, Token: claimed[2].Token, State: store.StateFailed, Error: &store.AttemptError{Attempt: 1, Error: "gone"}},
				{ID: claimed[3].ID, Token: claimed[3].Token, State: store.StateCancelled, Revoke: &reason},
				{ID: claimed[4].ID, Token: claimed[4].Token, State: store.StateAvailable, ReturnAttempt: true},
				{ID: claimed[5].ID, Token: claimed[5].Token + 1, State: store.StateCompleted}, // a stale token: not written
			}
			written, err := store.Finish(ctx, db, outs)
			if err != nil {
				t.Fatal(err)
			}
			var gotIDs []int64
			for _, w := range written {
				gotIDs = append(gotIDs, w.ID)
			}
			slices.Sort(gotIDs)
			wantIDs := []int64{outs[0].ID, outs[1].ID, outs[2].ID, outs[3].ID, outs[4].ID}
			slices.Sort(wantIDs)
			if !slices.Equal(gotIDs, wantIDs) {
				t.Fatalf("finish wrote %v; want %v", written, wantIDs)
			}
			for i, o := range outs[:5] {
				var st string
				var attempt int
				var lastErr, revokeReason, output *string
				var later bool
				if err := db0.QueryRow(ctx, `SELECT state, attempt, last_error, revoke_reason, output::text, run_at > now() + interval '30 minutes'
					FROM leash.jobs WHERE id = $1`, o.ID).Scan(&st, &attempt, &lastErr, &revokeReason, &output, &later); err != nil {
					t.Fatal(err)
				}
				ok := st == o.State
				switch i {
				case 0:
					ok = ok && output != nil && *output == `{"ok": true}`
				case 1:
					ok = ok && lastErr != nil && *lastErr == `it "broke"` && later
				case 2:
					ok = ok && lastErr != nil && *lastErr == "gone"
				case 3:
					ok = ok && revokeReason != nil && *revokeReason == reason
				case 4:
					ok = ok && attempt == 0
				}
				if !ok {
					t.Errorf("outcome %d %+v: row is %s, attempt %d, last_error %v, revoke_reason %v, output %v, later %v",
						i, o, st, attempt, deref(lastErr), deref(revokeReason), deref(output), later)
				}
			}

			// The outcome of the last job claimed and a claim, pipelined (the hand-back is
			// available again).
			last := claimed[5]
			written, jobs, err = store.FinishAndClaim(ctx, db,
				[]store.Outcome{{ID: last.ID, Token: last.Token, State: store.StateCompleted}}, params(10, "default", "other"))
			if err != nil || len(written) != 1 || written[0].ID != last.ID || written[0].State != store.StateCompleted {
				t.Fatalf("finish and claim: wrote %v, %v", written, err)
			}
			if len(jobs) != 2 {
				t.Fatalf("finish and claim: claimed %d jobs; want 2 (the hand-back and the job of queue other)", len(jobs))
			}
		})
	}
}

// The arrays an outcome batch encodes in place reach PostgreSQL as they were in every exec
// mode: text elements with quotes, backslashes, braces, commas, blanks, the word NULL and none
// at all; the extreme bigints; an empty array and NULL.
func TestOutcomeArraysUnderExecMode(t *testing.T) {
	t.Parallel()
	texts := [][]string{
		{"completed", "", `"`, `\`, `a"b\c`, "{x,y}", "NULL", "null", " spaced ", "tab\tnew\nline", "ünïcode", "a,b", "'quote'"},
		{},
		nil,
	}
	ints := [][]int64{{0, 1, -1, math.MaxInt64, math.MinInt64, 42}, {}, nil}
	for _, mode := range execModes {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := poolInMode(t, pgtest.URL(t), mode)
			for _, want := range texts {
				var got []string
				var null bool
				if err := db.QueryRow(ctx, `SELECT $1::text[], $1::text[] IS NULL`, store.TextArray(want)).Scan(&got, &null); err != nil {
					t.Fatalf("text[] %q: %v", want, err)
				}
				if !slices.Equal(got, want) || null != (want == nil) {
					t.Errorf("text[] %q arrived as %q (NULL: %v)", want, got, null)
				}
			}
			for _, want := range ints {
				var got []int64
				var null bool
				if err := db.QueryRow(ctx, `SELECT $1::bigint[], $1::bigint[] IS NULL`, store.Int8Array(want)).Scan(&got, &null); err != nil {
					t.Fatalf("bigint[] %v: %v", want, err)
				}
				if !slices.Equal(got, want) || null != (want == nil) {
					t.Errorf("bigint[] %v arrived as %v (NULL: %v)", want, got, null)
				}
			}
		})
	}
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}
