package main

import (
	"context"
	"fmt"
)

// statementCostSQL creates, in a fresh database, two copies of leash.jobs holding 100 jobs: one
// with the table's columns and defaults alone, one with its checks too (neither has indexes or
// triggers, so every update stays on its page), and a function that times UPDATE statements of
// the first rows of a table, each executed anew (a statement's checks and triggers are prepared
// for each execution, as for each claim and outcome batch).
const statementCostSQL = `
	CREATE TABLE public.jobs_plain (LIKE leash.jobs INCLUDING DEFAULTS);
	CREATE TABLE public.jobs_checked (LIKE leash.jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
	INSERT INTO public.jobs_plain (id, kind) SELECT g, 'noop' FROM generate_series(1, 100) g;
	INSERT INTO public.jobs_checked (id, kind) SELECT g, 'noop' FROM generate_series(1, 100) g;
	INSERT INTO leash.jobs (kind) SELECT 'noop' FROM generate_series(1, 100);
	CREATE FUNCTION public.time_updates(tbl regclass, statements int, rows_each int) RETURNS double precision
	LANGUAGE plpgsql AS $$
	DECLARE
		began timestamptz;
		first bigint;
	BEGIN
		EXECUTE format('SELECT min(id) FROM %s', tbl) INTO first;
		began := clock_timestamp();
		FOR i IN 1..statements LOOP
			-- Statements of one row take the 100 rows in turn, so that no row piles up versions.
			EXECUTE format('UPDATE %s SET state = state WHERE id BETWEEN $1 AND $2', tbl)
				USING first + (i % (101 - rows_each)), first + (i % (101 - rows_each)) + rows_each - 1;
		END LOOP;
		RETURN extract(epoch FROM clock_timestamp() - began) * 1e6 / statements;
	END $$`

// statementCosts: what leash.jobs' checks and row triggers cost each UPDATE statement that sets
// state (every claim and outcome batch) and each row of it, timed inside the server so that
// neither the client nor the network counts. Checks are parsed from their stored text and
// prepared once per statement, then evaluated per row; the triggers' WHENs likewise, per
// statement. Measured by difference, interleaved: the table without checks against the one with
// them, and leash.jobs with its triggers against the same table with triggers off
// (session_replication_role = replica, which needs a superuser: the bench's own cluster).
func (b *bench) statementCosts(ctx context.Context) {
	scenario := "UPDATE of state, per statement"
	logf("%s", scenario)
	db := open(ctx, b.freshDB(ctx), 1)
	defer db.Close()
	for _, q := range []string{statementCostSQL, `VACUUM ANALYZE public.jobs_plain, public.jobs_checked, leash.jobs`} {
		if _, err := db.Exec(ctx, q); err != nil {
			fail(fmt.Errorf("statement costs: %w", err))
		}
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		fail(err)
	}
	defer conn.Release()
	timed := func(table string, rows int, triggersOff bool) float64 {
		role := "origin"
		if triggersOff {
			role = "replica"
		}
		if _, err := conn.Exec(ctx, "SET session_replication_role = "+role); err != nil {
			fail(fmt.Errorf("statement costs: %w", err))
		}
		statements := 5000
		if rows > 1 {
			statements = 300
		}
		var us float64
		if err := conn.QueryRow(ctx, `SELECT public.time_updates($1::regclass, $2, $3)`, table, statements, rows).Scan(&us); err != nil {
			fail(fmt.Errorf("statement costs: %w", err))
		}
		return us
	}
	for _, rows := range []int{1, 100} {
		var ts []trial
		for _, v := range []struct {
			system, table string
			triggersOff   bool
			baseline      string
		}{
			{"copy, no checks", "public.jobs_plain", false, ""},
			{"copy, checks", "public.jobs_checked", false, "copy, no checks"},
		} {
			ts = append(ts, trial{system: v.system, baseline: baselines(v.baseline), run: func() float64 {
				return timed(v.table, rows, v.triggersOff)
			}})
		}
		if rows == 1 {
			// The statement's own cost: a hundred rows of leash.jobs updated over and over pile up
			// versions in its indexes, which one row at a time keeps small.
			ts = append(ts,
				trial{system: "leash.jobs, triggers off", run: func() float64 { return timed("leash.jobs", rows, true) }},
				trial{system: "leash.jobs, triggers on", baseline: baselines("leash.jobs, triggers off"),
					run: func() float64 { return timed("leash.jobs", rows, false) }})
		}
		b.trials(fmt.Sprintf("%s, %d row(s)", scenario, rows), "µs per statement", "µs", ts)
	}
}

func baselines(name string) []string {
	if name == "" {
		return nil
	}
	return []string{name}
}
