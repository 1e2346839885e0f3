package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Outcome batches and renewals are prepared statements whose generic plan is made for the
// table's size at the time. Made on an empty table, the outcome batch's plan hashes a scan of
// the whole table; RefreshJobsStats, called by a role with no right on the table (but EXECUTE on
// the function, which no role has unless granted), analyzes the grown table and the plan is
// made again, through the primary key. A second call finds the statistics current; a call that
// would wait for the table lock, or for another caller, returns at once without analyzing; a
// function whose owner may not analyze the table says so rather than let ANALYZE skip it.
func TestPlansFollowTableGrowth(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	conn, explainStmt := genericPlanConn(t, db) // autovacuum would analyze the table behind the test's back
	for _, q := range []string{
		"PREPARE fin(bigint[], bigint[], text[], bigint[], boolean[], jsonb[], text[], jsonb[]) AS " + store.FinishSQL,
		"PREPARE com(bigint[], bigint[], jsonb[]) AS " + store.CompleteSQL,
		"PREPARE ren(bigint[], bigint[], bigint) AS " + store.RenewSQL,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	explain := func(stmt string) string {
		t.Helper()
		return explainStmt(map[string]string{
			"fin": "EXECUTE fin('{1,2}', '{1,2}', '{completed,completed}', '{0,0}', '{f,f}', '{NULL,NULL}', '{NULL,NULL}', '{NULL,NULL}')",
			"com": "EXECUTE com('{1,2}', '{1,2}', '{NULL,NULL}')",
			"ren": "EXECUTE ren('{1,2}', '{1,2}', 1000)",
		}[stmt])
	}
	// Made first: a grant on the schema invalidates every cached plan.
	caller := connAsRole(t, db, "planner", "GRANT USAGE ON SCHEMA leash TO %s",
		"GRANT EXECUTE ON FUNCTION leash.refresh_jobs_stats() TO %s")
	// Nobody else may call it: the table lock it takes lasts until the caller's transaction ends.
	stranger := connAsRole(t, db, "stranger", "GRANT USAGE ON SCHEMA leash TO %s")
	var pgErr *pgconn.PgError
	if _, err := store.RefreshJobsStats(ctx, stranger); !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("a role never granted EXECUTE called leash.refresh_jobs_stats(): %v", err)
	}
	explain("fin") // the generic plan is made now, on the empty table
	explain("com")
	explain("ren")
	grow := func(rows int) {
		t.Helper()
		if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, queue) SELECT 'noop', 'elsewhere' FROM generate_series(1, $1)`, rows); err != nil {
			t.Fatal(err)
		}
	}
	grow(20000) // about 330 pages
	if plan := explain("fin"); !strings.Contains(plan, "Seq Scan on jobs") {
		t.Fatalf("the outcome batch's plan made on an empty table no longer scans it: this test shows nothing\n%s", plan)
	}
	if plan := explain("com"); !strings.Contains(plan, "Seq Scan on jobs") {
		t.Fatalf("the outcome batch's plan made on an empty table no longer scans it: this test shows nothing\n%s", plan)
	}

	refresh := func() bool {
		t.Helper()
		// Never waits long: not for the table lock, not for another caller.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		analyzed, err := store.RefreshJobsStats(ctx, caller)
		if err != nil {
			t.Fatal(err)
		}
		return analyzed
	}
	if !refresh() {
		t.Fatal("a table of 330 pages never analyzed was not analyzed")
	}
	for _, stmt := range []string{"fin", "com", "ren"} {
		if plan := explain(stmt); strings.Contains(plan, "Seq Scan on jobs") {
			t.Fatalf("%s: generic plan after the refresh still scans the table:\n%s", stmt, plan)
		}
	}
	if refresh() {
		t.Fatal("analyzed again a table that had not grown")
	}

	grow(30000) // more than twice the pages analyzed
	hold := func(sql string) (release func()) {
		t.Helper()
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback(ctx) })
		return func() { tx.Rollback(ctx) }
	}
	release := hold("LOCK TABLE leash.jobs IN SHARE UPDATE EXCLUSIVE MODE") // as a running VACUUM holds it
	if refresh() {
		t.Fatal("analyzed while another transaction held the table lock ANALYZE needs")
	}
	release()
	release = hold("SELECT pg_advisory_xact_lock(30510766707204462)") // another caller analyzing
	if refresh() {
		t.Fatal("analyzed while another caller was analyzing")
	}
	release()
	owner := fmt.Sprintf("planner_owner_%d", time.Now().UnixNano()%1e9)
	t.Cleanup(func() {
		db.Exec(ctx, "ALTER FUNCTION leash.refresh_jobs_stats() OWNER TO CURRENT_USER")
		db.Exec(ctx, "DROP OWNED BY "+owner)
		db.Exec(ctx, "DROP ROLE IF EXISTS "+owner)
	})
	for _, q := range []string{
		"CREATE ROLE " + owner + " NOLOGIN",
		"GRANT USAGE, CREATE ON SCHEMA leash TO " + owner,
		"GRANT " + owner + " TO CURRENT_USER", // to give it a function without being superuser
		"ALTER FUNCTION leash.refresh_jobs_stats() OWNER TO " + owner,
	} {
		if _, err := db.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	_, err := store.RefreshJobsStats(ctx, caller)
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(pgErr.Message, "may not analyze") {
		t.Fatalf("a function whose owner may not analyze the table: %v", err)
	}
	if _, err := db.Exec(ctx, "ALTER FUNCTION leash.refresh_jobs_stats() OWNER TO CURRENT_USER"); err != nil {
		t.Fatal(err)
	}
	// The caller's statistics target does not apply (nor would its cost delay).
	if _, err := caller.Exec(ctx, "SET default_statistics_target = 1"); err != nil {
		t.Fatal(err)
	}
	if !refresh() {
		t.Fatal("a table grown to twice its analyzed pages was not analyzed")
	}
	var bounds int
	if err := db.QueryRow(ctx, `SELECT array_length(histogram_bounds::text::bigint[], 1) FROM pg_stats
		WHERE schemaname = 'leash' AND tablename = 'jobs' AND attname = 'id'`).Scan(&bounds); err != nil {
		t.Fatal(err)
	}
	if bounds < 50 {
		t.Fatalf("the histogram of ids has %d bounds: the caller's statistics target was used", bounds)
	}
	var pages, relpages int64
	if err := db.QueryRow(ctx, `SELECT pg_relation_size('leash.jobs') / 8192, relpages FROM pg_class WHERE oid = 'leash.jobs'::regclass`).Scan(&pages, &relpages); err != nil {
		t.Fatal(err)
	}
	if relpages != pages {
		t.Fatalf("pg_class records %d pages of %d after the refresh", relpages, pages)
	}
}
