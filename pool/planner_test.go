package pool_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/syncbuf"
)

// A running pool analyzes leash.jobs once it has outgrown its planner statistics, without
// waiting for autovacuum (turned off here), so that prepared statements are planned again for
// the grown table.
func TestPoolRefreshesPlannerStats(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, "ALTER TABLE leash.jobs SET (autovacuum_enabled = off)"); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.PlannerStatsInterval = 10 * time.Millisecond
	p, _ := setup(t, db, cfg, nil)
	start(t, p)
	// Rows of a queue this pool does not serve, so that they stay.
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, queue) SELECT 'noop', 'elsewhere' FROM generate_series(1, 20000)`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool {
		// Analyzed at least once, and (the insert may have been under way then) since the table
		// last doubled.
		var pages, relpages int64
		if err := db.QueryRow(ctx, `SELECT pg_relation_size('leash.jobs') / 8192, relpages FROM pg_class WHERE oid = 'leash.jobs'::regclass`).Scan(&pages, &relpages); err != nil {
			t.Fatal(err)
		}
		return relpages > 0 && 2*relpages >= pages
	})
}

// A refresh that fails (here as a statement timeout would) is tried again later and later, and
// warned about once.
func TestFailingPlannerStatsBackOff(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `CREATE OR REPLACE FUNCTION leash.refresh_jobs_stats() RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = 'query_canceled'; END $$`); err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	cfg := fastConfig()
	cfg.PlannerStatsInterval = 10 * time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	p, _ := setup(t, db, cfg, nil)
	start(t, p)
	failures := func() int { return strings.Count(logs.String(), "refreshing the statistics of leash.jobs failed") }
	waitFor(t, 10*time.Second, func() bool { return failures() > 0 })
	time.Sleep(600 * time.Millisecond) // sixty intervals: how often does it try again?
	out := logs.String()
	if n := failures(); n > 8 {
		t.Fatalf("%d failed refreshes logged within 600ms of the first with a 10ms interval; want at most 8 (backing off)", n)
	}
	if n := strings.Count(out, "level=WARN msg=\"refreshing the statistics"); n != 1 {
		t.Fatalf("%d warnings; want 1", n)
	}
}
