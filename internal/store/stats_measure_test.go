package store_test

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// TestMeasureAdminQueries measures, by hand, what the admin page and its minute sampling cost on
// a large table: LEASH_ADMIN_ROWS=3000000 go test ./internal/store -run MeasureAdminQueries -v
// -timeout 30m. It loads that many finished jobs spread evenly over the last 24 hours (the
// default retention of completed jobs), 90% completed, 7% failed, 3% cancelled, plus 100,000
// queued jobs (a tenth scheduled later) and 200 running ones, vacuums and analyzes, and prints
// the execution time of every statement (EXPLAIN ANALYZE, the best of five runs), the rows it
// read and its plan's top nodes.
func TestMeasureAdminQueries(t *testing.T) {
	rows, _ := strconv.Atoi(os.Getenv("LEASH_ADMIN_ROWS"))
	if rows <= 0 {
		t.Skip("set LEASH_ADMIN_ROWS (e.g. 3000000) to measure the admin queries on a large table")
	}
	ctx := context.Background()
	db := pgtest.Pool(t)
	start := time.Now()
	// In batches of a million, so that no single statement holds too much.
	for done := 0; done < rows; done += 1_000_000 {
		n := min(1_000_000, rows-done)
		_, err := db.Exec(ctx, `
			INSERT INTO leash.jobs (queue, kind, state, attempt, created_at, run_at, attempted_at, finished_at)
			SELECT CASE WHEN i % 10 = 0 THEN 'reports' ELSE 'default' END,
			       CASE WHEN i % 3 = 0 THEN 'http' ELSE 'noop' END,
			       CASE WHEN i % 100 < 90 THEN 'completed' WHEN i % 100 < 97 THEN 'failed' ELSE 'cancelled' END,
			       1, f - interval '2 seconds', f - interval '2 seconds',
			       f - interval '2 seconds' + (i % 1000) * interval '1 millisecond', f
			FROM (SELECT i, now() - (i::float8 / $2) * interval '24 hours' AS f
			      FROM generate_series($1::bigint, $1::bigint + $3 - 1) i) g`, done, rows, n)
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err := db.Exec(ctx, `
		INSERT INTO leash.jobs (queue, kind, state, run_at)
		SELECT 'default', 'noop', 'available', CASE WHEN i % 10 = 0 THEN now() + interval '1 hour' ELSE now() - interval '1 minute' END
		FROM generate_series(1, 100000) i;
		INSERT INTO leash.jobs (queue, kind, state, attempt, attempted_at, lease_token, lease_expires_at, leased_by, heartbeat_at)
		SELECT 'default', 'sleep', 'running', 1, now() - interval '10 seconds', i, now() + interval '30 seconds', 'w', now()
		FROM generate_series(1, 200) i`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, "VACUUM ANALYZE leash.jobs"); err != nil {
		t.Fatal(err)
	}
	var size string
	db.QueryRow(ctx, "SELECT pg_size_pretty(pg_total_relation_size('leash.jobs'))").Scan(&size)
	t.Logf("loaded %d finished jobs (%d in the last hour), 100000 queued, 200 running in %s; leash.jobs with indexes: %s",
		rows, rows/24, time.Since(start).Round(time.Second), size)

	// The sampling statements, for one minute (the usual case) and for a backfill of the hour.
	var now time.Time
	db.QueryRow(ctx, "SELECT now()").Scan(&now)
	last := now.Add(-store.SampleLagDefault).Truncate(time.Minute).Add(-time.Minute)
	hourAgo := last.Add(-59 * time.Minute)
	var minutes []time.Time
	for m := hourAgo; !m.After(last); m = m.Add(time.Minute) {
		minutes = append(minutes, m)
	}
	measure(t, db, "sample: queue depth", `SELECT count(*), count(*) FILTER (WHERE run_at <= $1)
		FROM leash.jobs WHERE state IN ('available', 'retryable')`, now)
	measureSample := func(name string, ms []time.Time) {
		measure(t, db, name, store.SampleMinutesSQL, ms, ms[0], ms[len(ms)-1].Add(time.Minute), last, int64(1), int64(1), now)
	}
	measureSample("sample: one minute", minutes[len(minutes)-1:])
	measureSample("sample: backfill of 60 minutes", minutes)

	// What the page reads at every load (and refresh).
	measure(t, db, "page: minute stats", `
		WITH b AS (SELECT date_trunc('minute', now()) - interval '1 minute' AS last)
		SELECT m, s.minute IS NOT NULL, coalesce(s.completed, 0), coalesce(s.failed, 0), coalesce(s.cancelled, 0),
		       coalesce(s.started, 0), s.pickup_p50_ms, s.pickup_p99_ms, s.queued, s.runnable
		FROM b CROSS JOIN generate_series(b.last - 59 * interval '1 minute', b.last, interval '1 minute') m
		LEFT JOIN leash.minute_stats s ON s.minute = m ORDER BY m`)
	for name, q := range store.StatusQueries {
		var args []any
		if strings.Contains(q, "$1") {
			args = append(args, 200)
		}
		measure(t, db, "page: "+name, q, args...)
	}
	measure(t, db, "page: recent failures", store.RecentFailuresSQL, 20)

	// The job list, by filter.
	list := func(name, where string, args ...any) {
		measure(t, db, "list: "+name, `SELECT id, queue, kind, state, attempt, max_attempts, created_at, run_at, finished_at, left(last_error, 200)
			FROM leash.jobs WHERE `+where+` ORDER BY id DESC LIMIT 51`, args...)
	}
	list("no filter", "true")
	list("queue", "queue = $1", "reports")
	list("state failed", "state = $1", "failed")
	list("state available", "state = $1", "available")
	list("queue, kind, state", "queue = $1 AND kind = $2 AND state = $3", "reports", "http", "cancelled")
	list("a kind no job has (worst case)", "kind = $1", "no-such-kind")
}

// measure prints the best of five EXPLAIN ANALYZE runs of sql, each in a transaction rolled back
// (a sampled minute is written again each time).
func measure(t *testing.T, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, name, sql string, args ...any) {
	t.Helper()
	ctx := context.Background()
	var best float64
	var plan []map[string]any
	for i := range 5 {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []byte
		err = tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, args...).Scan(&out)
		tx.Rollback(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := json.Unmarshal(out, &plan); err != nil {
			t.Fatal(err)
		}
		ms := plan[0]["Execution Time"].(float64)
		if i == 0 || ms < best {
			best = ms
		}
	}
	top := plan[0]["Plan"].(map[string]any)
	var nodes []string
	var walk func(n map[string]any, depth int)
	walk = func(n map[string]any, depth int) {
		if depth > 4 {
			return
		}
		s, _ := n["Node Type"].(string)
		if idx, ok := n["Index Name"].(string); ok {
			s += " " + idx
		}
		nodes = append(nodes, s)
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any), depth+1)
		}
	}
	walk(top, 0)
	slices.Sort(nodes)
	nodes = slices.Compact(nodes)
	t.Logf("%-42s %9.2f ms  shared hit+read %v+%v  %v", name, best, top["Shared Hit Blocks"], top["Shared Read Blocks"], nodes)
}
