package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Retention's statement reads indexes only, under a generic plan (which estimates LIMIT $2 at a
// tenth of the table) and under a custom one, on a table of finished jobs among which one
// belongs to a workflow: neither plan may read the whole table (the delete joined by hashing a
// scan of it, and the check of the workflow's unfinished jobs scanned it).
func TestRetentionPlansReadIndexesOnly(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	conn, explain := genericPlanConn(t, db)
	for _, q := range []string{
		`INSERT INTO leash.jobs (kind, state, attempt, finished_at)
		 SELECT 'noop', CASE WHEN g % 50 = 0 THEN 'failed' ELSE 'completed' END, 1, now() - interval '2 days' + g * interval '1 second'
		 FROM generate_series(1, 20000) g`,
		`INSERT INTO leash.workflows (id, name) VALUES (1, 'w')`,
		`INSERT INTO leash.jobs (kind, workflow_id, step, state, attempt, finished_at)
		 VALUES ('noop', 1, 'a', 'completed', 1, now() - interval '3 days'), ('noop', 1, 'b', 'failed', 1, now() - interval '3 days')`,
		`ANALYZE leash.jobs`,
	} {
		if _, err := db.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		for _, completed := range []bool{true, false} {
			if _, err := conn.Exec(ctx, "PREPARE del(bigint, int) AS "+store.DeleteFinishedSQL(completed)); err != nil {
				t.Fatal(err)
			}
			if plan := explain("EXECUTE del(3600000, 1000)"); strings.Contains(plan, "Seq Scan on jobs") {
				t.Errorf("%s, completed %v: retention reads the table:\n%s", mode, completed, plan)
			}
			if _, err := conn.Exec(ctx, "DEALLOCATE del"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// And it deletes what it should: the finished jobs older than the age, the workflow's too
	// (it has no unfinished job).
	n, err := store.DeleteFinished(ctx, db, true, 24*time.Hour, 100000)
	if err != nil {
		t.Fatal(err)
	}
	var left int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state = 'completed' AND finished_at < now() - interval '1 day'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if n == 0 || left != 0 {
		t.Fatalf("deleted %d completed jobs older than a day, %d left", n, left)
	}
}
