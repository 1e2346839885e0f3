package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// A connection's claims run the generic plan of their prepared statement: planned once, not at
// every claim, as PostgreSQL's default plan_cache_mode would (a custom plan for each claim, whose
// planning cost as much as the claim's execution), and whatever plan_cache_mode the session
// sets.
func TestClaimsRunTheirGenericPlan(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind) SELECT 'k' FROM generate_series(1, 2000)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `ANALYZE leash.jobs`); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// A session that asks for custom plans, and turns off the paths the claim's plan takes: the
	// claim's own settings win for its transaction.
	if _, err := conn.Exec(ctx, `SET plan_cache_mode = force_custom_plan; SET enable_tidscan = off; SET enable_nestloop = off`); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, `RESET plan_cache_mode; RESET enable_tidscan; RESET enable_nestloop`)
	if err := store.EnsureQueues(ctx, conn, []string{"default"}); err != nil {
		t.Fatal(err)
	}
	var cursor *store.ClaimCursor
	claimed := 0
	for range 12 {
		jobs, err := store.Claim(ctx, conn, store.ClaimParams{Queues: []string{"default"}, Limit: 10, WorkerID: "w",
			Lease: time.Minute, After: cursor, Lag: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if len(jobs) != 10 {
			t.Fatalf("claim took %d; want 10", len(jobs))
		}
		claimed += len(jobs)
		cursor = store.LastClaimed(jobs)
	}
	var mode string
	if err := conn.QueryRow(ctx, `SHOW plan_cache_mode`).Scan(&mode); err != nil || mode != "force_custom_plan" {
		t.Fatalf("the session's plan_cache_mode after the claims: %q, %v; want its own setting back", mode, err)
	}
	var off int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_settings WHERE name IN ('enable_tidscan', 'enable_nestloop') AND setting = 'off'`).Scan(&off); err != nil || off != 2 {
		t.Fatalf("the session's own planner settings after the claims: %d of 2 still off, %v", off, err)
	}
	rows, err := conn.Query(ctx, `SELECT generic_plans, custom_plans, left(statement, 60) FROM pg_prepared_statements
		WHERE statement LIKE '%UPDATE leash.jobs j%' AND statement LIKE '%FOR UPDATE SKIP LOCKED%'
		  AND statement NOT LIKE '%pg_prepared_statements%'`)
	if err != nil {
		t.Fatal(err)
	}
	type plans struct {
		Generic, Custom int64
		Statement       string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[plans])
	if err != nil {
		t.Fatal(err)
	}
	var generic int64
	for _, p := range got {
		if p.Custom != 0 {
			t.Errorf("claim statement %q: %d custom plans, %d generic", p.Statement, p.Custom, p.Generic)
		}
		generic += p.Generic
	}
	if generic < 12 {
		t.Fatalf("claims ran %d generic plans (%+v); want one per claim, 12", generic, got)
	}
}

// Under the settings a claim runs with, the generic plan of each claim statement reads indexes
// and leases its rows one probe each, whatever the table held when it was planned (a plan is
// cached for the connection until the statistics change): empty and never analyzed (a fresh
// database), empty and analyzed (an idle night
// after retention), a page of rows, and many finished jobs beside a backlog. Never a sequential
// scan of leash.jobs: hashed for the lease's join (which the generic plan's estimate of a tenth
// of the rows for LIMIT $2 makes look cheaper on a table of some 50,000 rows, without
// enable_hashjoin off), or, on a table of a page, for the picked rows and once per picked row
// for the lease (4 s a claim once the table had grown, without enable_seqscan off).
func TestClaimGenericPlanWhateverTheTable(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, state := range []struct {
		name string
		sql  []string
	}{
		{"empty, never analyzed", []string{`ALTER TABLE leash.jobs SET (autovacuum_enabled = off)`}},
		{"empty, analyzed", []string{`VACUUM ANALYZE leash.jobs`}},
		{"ten rows, analyzed", []string{`INSERT INTO leash.jobs (queue, kind) SELECT 'q', 'k' FROM generate_series(1, 10)`, `VACUUM ANALYZE leash.jobs`}},
		{"finished jobs and a backlog", []string{
			`INSERT INTO leash.jobs (queue, kind, state, attempt, finished_at)
			 SELECT 'q', 'k', 'completed', 1, now() - i * interval '1 second' FROM generate_series(1, 25000) i`,
			`INSERT INTO leash.jobs (queue, kind) SELECT 'q', 'k' FROM generate_series(1, 20000)`,
			`INSERT INTO leash.jobs (queue, kind) SELECT 'r', 'k' FROM generate_series(1, 5000)`,
			`ANALYZE leash.jobs`,
		}},
	} {
		for _, q := range state.sql {
			if _, err := db.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		explainClaims(t, db, state.name)
	}
	if _, err := db.Exec(ctx, `ALTER TABLE leash.jobs RESET (autovacuum_enabled)`); err != nil {
		t.Fatal(err)
	}
}

func explainClaims(t *testing.T, db *pgxpool.Pool, state string) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, store.ClaimPlanSQL); err != nil {
		t.Fatal(err)
	}
	cursor := &store.ClaimCursor{RunAt: time.Now(), ID: 30000}
	for i, p := range []store.ClaimParams{
		{Queues: []string{"q"}, Limit: 100, WorkerID: "w", Lease: time.Minute},
		{Queues: []string{"q"}, Limit: 100, WorkerID: "w", Lease: time.Minute, After: cursor, Lag: 100 * time.Millisecond, RecheckFromID: 29000},
		{Queues: []string{"q", "r"}, Limit: 100, WorkerID: "w", Lease: time.Minute},
	} {
		q, args := store.ClaimQuery(p)
		name := fmt.Sprintf("explained_claim%d_%d", i, time.Now().UnixNano()) // a session's, whatever the transaction
		if _, err := tx.Exec(ctx, "PREPARE "+name+" AS "+q); err != nil {
			t.Fatal(err)
		}
		lits := make([]string, len(args))
		for j, a := range args {
			switch v := a.(type) {
			case string:
				lits[j] = "'" + v + "'"
			case []string:
				lits[j] = "ARRAY['" + strings.Join(v, "','") + "']"
			case time.Time:
				lits[j] = "'" + v.Format(time.RFC3339Nano) + "'::timestamptz"
			default:
				lits[j] = fmt.Sprint(v)
			}
		}
		rows, err := tx.Query(ctx, "EXPLAIN (COSTS OFF) EXECUTE "+name+"("+strings.Join(lits, ", ")+")")
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(lines, "\n")
		generic := strings.Contains(text, "$1") // a custom plan shows the values
		bad := !generic || strings.Contains(text, "Seq Scan on jobs") || strings.Contains(text, "Hash") || strings.Contains(text, "Merge")
		// Every index scan of leash.jobs has a condition (none walks a whole index), and the
		// rows are leased by TID or by primary-key probes of their ids.
		for k, l := range lines {
			if strings.Contains(l, "Index Scan using") && strings.Contains(l, " on jobs") &&
				(k+1 == len(lines) || !strings.Contains(lines[k+1], "Index Cond")) {
				bad = true
			}
		}
		leased := strings.Contains(text, "Tid Scan on jobs j") || strings.Contains(text, "Index Scan using jobs_pkey on jobs j\n") ||
			(strings.Contains(text, "Bitmap Heap Scan on jobs j\n") && strings.Contains(text, "Bitmap Index Scan on jobs_pkey"))
		if bad || !leased {
			t.Fatalf("claim %d, table %s: generic plan under the claim's settings:\n%s", i, state, text)
		}
	}
}
