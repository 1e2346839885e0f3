package store_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A batch of completions alone is written by a statement of its own (three arrays, the columns a
// completion sets), which must store what the general outcome statement stores, for every kind
// of row a completion meets: plain, with an output (valid, with a NUL, with a number jsonb refuses), over an earlier
// output and an errors history, revoked while running, keyed under a limit with a job of its key
// waiting, a workflow's job whose dependent it releases, and one whose lease was lost. Two
// databases are set up alike; one is written by the general statement, the other by Finish.
func TestCompletionsWriteWhatTheGeneralOutcomeWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	done := store.Outcome{State: store.StateCompleted}
	if q := store.FinishStatement([]store.Outcome{done, done}); q != store.CompleteSQL {
		t.Fatal("a batch of completions is not written by the completions' statement")
	}
	for _, o := range []store.Outcome{
		{State: store.StateFailed}, {State: store.StateCompleted, ReturnAttempt: true},
		{State: store.StateCompleted, Error: &store.AttemptError{Error: "e"}}, {State: store.StateCompleted, Revoke: new(string)},
	} {
		if q := store.FinishStatement([]store.Outcome{done, o}); q != store.FinishSQL {
			t.Errorf("a batch with %+v beside a completion is not written by the general statement", o)
		}
	}

	type result struct {
		written []string
		rows    []string
		wakes   int
	}
	run := func(general bool) result {
		db := pgtest.Pool(t)
		exec(t, db, `SELECT leash.set_queue_max_running_per_key('default', 1)`)
		exec(t, db, `INSERT INTO leash.jobs (kind, output) VALUES ('plain', NULL), ('valid', NULL), ('nul', NULL), ('number', NULL),
			('revoked', NULL), ('history', NULL), ('earlier', '{"old": true}'), ('stale', NULL)`)
		exec(t, db, `UPDATE leash.jobs SET errors = '[{"attempt": 1, "error": "old"}]', last_error = 'old', attempt = 1 WHERE kind = 'history'`)
		exec(t, db, `INSERT INTO leash.jobs (kind, concurrency_key) VALUES ('keyed', 'k1'), ('keyed-waiting', 'k1')`)
		wid := newWorkflow(t, db)
		exec(t, db, `INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) VALUES ('step', $1, 'a', NULL), ('step', $1, 'b', '{a}')`, wid)
		// Claimed as a claim leases them; the waiting job of the key stays queued, as a claim under
		// its limit would leave it, and b waits for a.
		rows, err := db.Query(ctx, `UPDATE leash.jobs SET state = 'running', lease_token = id + 1000, leased_by = 'w',
			lease_expires_at = now() + interval '1 hour', attempt = attempt + 1, attempted_at = now()
			WHERE state = 'available' AND kind <> 'keyed-waiting' RETURNING id, kind, lease_token`)
		if err != nil {
			t.Fatal(err)
		}
		type claimedRow struct {
			ID    int64
			Kind  string
			Token int64
		}
		claimed, err := pgx.CollectRows(rows, pgx.RowToStructByPos[claimedRow])
		if err != nil {
			t.Fatal(err)
		}
		outputs := map[string][]byte{"valid": []byte(`{"n": 1}`), "nul": []byte(`{"s": "a\u0000b"}`),
			"number": []byte(`{"n": 1e999999}`)}
		var outs []store.Outcome
		for _, j := range claimed {
			o := store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted, Output: outputs[j.Kind]}
			switch j.Kind {
			case "revoked":
				exec(t, db, `UPDATE leash.jobs SET revoked_at = now(), revoke_reason = 'operator' WHERE id = $1`, j.ID)
			case "stale":
				o.Token++
			}
			outs = append(outs, o)
		}
		if len(outs) != 10 {
			t.Fatalf("claimed %d jobs, want 10 (keyed-waiting and b wait)", len(outs))
		}
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		var r result
		if general {
			n := len(outs)
			ids, tokens, states := make([]int64, n), make([]int64, n), make([]string, n)
			delays, giveBack, errs, revokes, outputs := make([]int64, n), make([]bool, n), make([]*string, n), make([]*string, n), make([]*string, n)
			for i, o := range outs {
				ids[i], tokens[i], states[i] = o.ID, o.Token, o.State
				outputs[i] = store.CleanOutput(o.Output)
			}
			rows, err := tx.Query(ctx, store.FinishSQL, ids, tokens, states, delays, giveBack, errs, revokes, outputs)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var id int64
				var state string
				var notified *bool
				var frees bool
				if err := rows.Scan(&id, &state, &notified, &frees); err != nil {
					t.Fatal(err)
				}
				r.written = append(r.written, fmt.Sprint(id, state, frees))
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
		} else {
			ws, err := store.Finish(ctx, tx, outs)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range ws {
				r.written = append(r.written, fmt.Sprint(w.ID, w.State, w.Frees))
			}
		}
		r.rows = jobRowsAsWritten(t, tx)
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes`).Scan(&r.wakes); err != nil {
			t.Fatal(err)
		}
		return r
	}
	general, completions := run(true), run(false)
	if len(general.written) != 9 {
		t.Errorf("the general statement wrote %d outcomes, want 9 (all but the stale lease's)", len(general.written))
	}
	if !reflect.DeepEqual(general.written, completions.written) {
		t.Errorf("rows returned differ:\ngeneral:     %v\ncompletions: %v", general.written, completions.written)
	}
	if len(general.rows) != len(completions.rows) {
		t.Fatalf("%d rows against %d", len(general.rows), len(completions.rows))
	}
	for i := range general.rows {
		if general.rows[i] != completions.rows[i] {
			t.Errorf("row differs:\ngeneral:     %s\ncompletions: %s", general.rows[i], completions.rows[i])
		}
	}
	if general.wakes != completions.wakes || general.wakes == 0 {
		t.Errorf("key wakes: %d by the general statement, %d by the completions' (want the same, not 0)", general.wakes, completions.wakes)
	}
}

// jobRowsAsWritten is every row of leash.jobs as JSON in id order, each timestamp read as null,
// "now" (the transaction's) or "earlier", so that two databases written alike compare equal.
func jobRowsAsWritten(t *testing.T, tx pgx.Tx) []string {
	t.Helper()
	rows, err := tx.Query(context.Background(), `
		SELECT (SELECT jsonb_object_agg(e.key, CASE
		            WHEN jsonb_typeof(e.value) = 'string' AND c.data_type = 'timestamp with time zone' THEN
		                CASE WHEN (e.value #>> '{}')::timestamptz = now() THEN '"now"'::jsonb ELSE '"earlier"'::jsonb END
		            ELSE e.value END)
		        FROM jsonb_each(to_jsonb(j)) e
		        JOIN information_schema.columns c ON c.table_schema = 'leash' AND c.table_name = 'jobs' AND c.column_name = e.key)::text
		FROM leash.jobs j ORDER BY j.id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}
