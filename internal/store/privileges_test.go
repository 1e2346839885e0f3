package store_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// readmeGrants returns the GRANT lines of docs/sql.md (section Privileges) for the example role name,
// with %s in its place, for connAsRole.
func readmeGrants(t *testing.T, role string) []string {
	t.Helper()
	b, err := os.ReadFile("../../docs/sql.md")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "GRANT ") && strings.HasSuffix(line, " TO "+role+";") {
			out = append(out, strings.TrimSuffix(line, role+";")+"%s")
		}
	}
	if len(out) == 0 {
		t.Fatalf("docs/sql.md names no GRANT ... TO %s", role)
	}
	return out
}

// Nothing in schema leash is readable by every role but the two wake-up hints (timestamps the
// triggers' WHEN reads as whoever inserts or finishes jobs) and the count of queues with a per-key
// limit (read so too), and no function running with its
// owner's rights is executable by every role. A role with USAGE on the schema alone reads no
// table: not the schedules' payloads, not the queues, not the waiting workers.
func TestNothingReadableWithoutAGrant(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	rows, err := db.Query(ctx, `
		SELECT c.relname || ' ' || a.privilege_type
		FROM pg_class c, aclexplode(c.relacl) a
		WHERE c.relnamespace = 'leash'::regnamespace AND a.grantee = 0
		  AND c.relname NOT IN ('waiting_until', 'room_waiting_until', 'keyed_queues')
		UNION ALL
		SELECT c.relname || ' ' || a.attname || ' ' || x.privilege_type
		FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid, aclexplode(a.attacl) x
		WHERE c.relnamespace = 'leash'::regnamespace AND x.grantee = 0
		UNION ALL
		SELECT p.oid::regprocedure::text || ' EXECUTE'
		FROM pg_proc p
		WHERE p.pronamespace = 'leash'::regnamespace AND p.prosecdef
		  AND (p.proacl IS NULL OR EXISTS (SELECT FROM aclexplode(p.proacl) a WHERE a.grantee = 0))
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	public, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(public) > 0 {
		t.Errorf("granted to PUBLIC in schema leash:\n%s", strings.Join(public, "\n"))
	}

	if err := store.UpsertSchedule(ctx, db, store.ScheduleRow{Name: "hook", Spec: "@hourly", Kind: "http",
		Payload: []byte(`{"url":"https://example.com","headers":{"Authorization":"Bearer secret"}}`), Queue: "default", MaxAttempts: 20}); err != nil {
		t.Fatal(err)
	}
	if err := store.RegisterWaiter(ctx, db, "w", []string{"default"}, time.Minute); err != nil {
		t.Fatal(err)
	}
	exec(t, db, `SELECT leash.pause_queue('default')`)
	stranger := connAsRole(t, db, "leash_stranger", "GRANT USAGE ON SCHEMA leash TO %s")
	rows, err = db.Query(ctx, `SELECT c.oid::regclass::text FROM pg_class c
		WHERE c.relnamespace = 'leash'::regnamespace AND c.relkind IN ('r', 'S', 'v', 'm', 'p')
		  AND c.relname NOT IN ('waiting_until', 'room_waiting_until', 'keyed_queues') ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	rels, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, rel := range append(rels, "leash.schedules", "leash.queues", "leash.waiters") {
		if _, err := stranger.Exec(ctx, "SELECT * FROM "+rel); err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("a role with USAGE on the schema alone read %s: %v", rel, err)
		}
	}
}

// A role of the inserter grants of docs/sql.md inserts jobs from SQL and through every insert of the
// Go API, while a worker waits (the insert trigger then reads leash.waiters and leash.queues
// with its owner's rights) or not, and reads no payload. The operator of docs/sql.md revokes,
// retries, pauses and resumes, and reads no table.
func TestREADMEInserterAndOperatorGrants(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	ins := connAsRole(t, db, "leash_inserter", readmeGrants(t, "leash_inserter")...)
	for i, waiting := range []bool{false, true} {
		if waiting {
			if err := store.RegisterWaiter(ctx, db, "w", []string{"default"}, time.Minute); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := ins.Exec(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('k', '{}')`); err != nil {
			t.Fatalf("waiting %v: plain insert: %v", waiting, err)
		}
		if _, err := store.Insert(ctx, ins, jp(store.InsertParams{Kind: "k"})); err != nil {
			t.Fatalf("waiting %v: Insert: %v", waiting, err)
		}
		key := fmt.Sprintf("key-%d", i)
		if _, _, err := store.InsertUnique(ctx, ins, jp(store.InsertParams{Kind: "k", UniqueKey: key, UniqueWithin: time.Hour})); err != nil {
			t.Fatalf("waiting %v: InsertUnique: %v", waiting, err)
		}
		if _, dup, err := store.InsertUnique(ctx, ins, jp(store.InsertParams{Kind: "k", UniqueKey: key, UniqueWithin: time.Hour})); err != nil || !dup {
			t.Fatalf("waiting %v: InsertUnique again: duplicate %v, %v", waiting, dup, err)
		}
		if n, err := store.InsertMany(ctx, ins, []store.InsertParams{jp(store.InsertParams{Kind: "k"}), jp(store.InsertParams{Kind: "k"})}); err != nil || n != 2 {
			t.Fatalf("waiting %v: InsertMany: %d, %v", waiting, n, err)
		}
	}
	if _, err := ins.Exec(ctx, `SELECT payload FROM leash.jobs`); err == nil {
		t.Fatal("the inserter read payloads")
	}
	// A workflow, through the Go API's statements and from plain SQL.
	tx, err := ins.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wid, err := store.CreateWorkflow(ctx, tx, "w")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.InsertWorkflowJobs(ctx, tx, wid, []store.WorkflowJob{
		{Step: "a", Params: jp(store.InsertParams{Kind: "k"})}, {Step: "b", DependsOn: []string{"a"}, Params: jp(store.InsertParams{Kind: "k"})},
	}); err != nil {
		t.Fatalf("InsertWorkflowJobs: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit a workflow: %v", err)
	}
	if _, err := ins.Exec(ctx, `WITH w AS (INSERT INTO leash.workflows (name) VALUES ('sql') RETURNING id)
		INSERT INTO leash.jobs (kind, workflow_id, step, depends_on) SELECT 'k', w.id, s, d FROM w,
		(VALUES ('x', NULL::text[]), ('y', '{x}')) v(s, d)`); err != nil {
		t.Fatalf("plain SQL workflow: %v", err)
	}

	id, err := store.Insert(ctx, db, jp(store.InsertParams{Kind: "k"}))
	if err != nil {
		t.Fatal(err)
	}
	op := connAsRole(t, db, "leash_operator", readmeGrants(t, "leash_operator")...)
	for _, q := range []string{
		fmt.Sprintf(`SELECT leash.revoke_job(%d, 'by operator')`, id),
		fmt.Sprintf(`SELECT leash.retry_job(%d)`, id),
		`SELECT leash.pause_queue('default')`,
		`SELECT leash.resume_queue('default')`,
		fmt.Sprintf(`SELECT leash.revoke_workflow(%d, 'by operator') = 2`, wid),
		`SELECT leash.set_queue_key_rate_limit('default', 5, interval '1 minute')`,
		`SELECT leash.set_queue_key_rate_limit('default', NULL)`,
	} {
		var ok bool
		if err := op.QueryRow(ctx, q).Scan(&ok); err != nil || !ok {
			t.Fatalf("operator: %s: %v, %v", q, ok, err)
		}
	}
	for _, rel := range []string{"leash.jobs", "leash.schedules", "leash.queues", "leash.waiters", "leash.workflows", "leash.workflow_edges"} {
		if _, err := op.Exec(ctx, "SELECT * FROM "+rel); err == nil {
			t.Errorf("the operator read %s", rel)
		}
	}
}

// The statistics target of leash.refresh_jobs_stats() is the database's (or PostgreSQL's default),
// never the caller's: not one SET in the session, nor one its client sent at connection
// (PGOPTIONS, or ALTER ROLE ... SET, which both make the session's reset value).
func TestRefreshJobsStatsTargetIsNotTheCallers(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	role := fmt.Sprintf("leash_stats_%d", time.Now().UnixNano()%1e9)
	exec(t, db, "CREATE ROLE "+role+" NOLOGIN")
	exec(t, db, "GRANT USAGE ON SCHEMA leash TO "+role)
	exec(t, db, "GRANT EXECUTE ON FUNCTION leash.refresh_jobs_stats() TO "+role)
	t.Cleanup(func() {
		db.Exec(ctx, "DROP OWNED BY "+role)
		db.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	cfg := db.Config().ConnConfig.Copy()
	cfg.RuntimeParams["default_statistics_target"] = "1" // as PGOPTIONS='-c default_statistics_target=1'
	caller, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caller.Close(ctx) })
	if _, err := caller.Exec(ctx, "SET ROLE "+role); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "ALTER TABLE leash.jobs SET (autovacuum_enabled = off)") // it would analyze behind the test's back
	bounds := func(rows int) int {
		t.Helper()
		exec(t, db, `INSERT INTO leash.jobs (kind, queue) SELECT 'noop', 'elsewhere' FROM generate_series(1, $1)`, rows)
		analyzed, err := store.RefreshJobsStats(ctx, caller)
		if err != nil || !analyzed {
			t.Fatalf("refresh after %d rows: analyzed %v, %v", rows, analyzed, err)
		}
		var n int
		if err := db.QueryRow(ctx, `SELECT array_length(histogram_bounds::text::bigint[], 1) FROM pg_stats
			WHERE schemaname = 'leash' AND tablename = 'jobs' AND attname = 'id'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := bounds(20000); n != 101 {
		t.Fatalf("the histogram of ids has %d bounds, want 101 (the default target, 100): the caller's target was used", n)
	}
	var dbName string
	if err := db.QueryRow(ctx, "SELECT current_database()").Scan(&dbName); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "ALTER DATABASE "+pgx.Identifier{dbName}.Sanitize()+" SET default_statistics_target = 10")
	if n := bounds(30000); n != 11 {
		t.Fatalf("the histogram of ids has %d bounds, want 11 (the database's target, 10)", n)
	}
}
