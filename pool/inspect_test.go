package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// GetJob reads every column a program needs without SQL of its own; an unknown id is
// ErrJobNotFound.
func TestGetJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	id, err := pool.Insert(ctx, db, "mail", map[string]string{"to": "a@example.com"}, &pool.InsertOpts{Queue: "q", UniqueKey: "k1", Priority: 3})
	if err != nil {
		t.Fatal(err)
	}
	j, err := pool.GetJob(ctx, db, id)
	if err != nil {
		t.Fatal(err)
	}
	var payload map[string]string
	if err := json.Unmarshal(j.Payload, &payload); err != nil || payload["to"] != "a@example.com" {
		t.Fatalf("payload %s: %v", j.Payload, err)
	}
	if j.ID != id || j.Kind != "mail" || j.Queue != "q" || j.State != pool.StateAvailable || j.UniqueKey != "k1" || j.Priority != 3 ||
		j.Attempt != 0 || j.MaxAttempts != pool.MaxAttemptsDefault || j.LeaseToken != nil || j.LeasedBy != "" || j.Output != nil ||
		j.Progress != nil || !json.Valid(j.Errors) || j.CreatedAt.IsZero() {
		t.Fatalf("job %+v", j)
	}
	if _, err := pool.GetJob(ctx, db, id+1000); !errors.Is(err, pool.ErrJobNotFound) {
		t.Fatalf("unknown job: %v", err)
	}
}

// ListJobs filters by queue, kind and state and pages by id (keyset): following BeforeID from
// page to page visits every matching job once, newest first. Limits out of bounds and unknown
// states are refused, not clamped.
func TestListJobsPagesAndFilters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	var want []int64
	for i := range 7 {
		id, err := pool.Insert(ctx, db, "a", nil, &pool.InsertOpts{Queue: "q"})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
		if _, err := pool.Insert(ctx, db, []string{"a", "b"}[i%2], nil, &pool.InsertOpts{Queue: "other"}); err != nil {
			t.Fatal(err)
		}
	}
	slices.Reverse(want)
	var got []int64
	var before int64
	for pages := 0; ; pages++ {
		page, err := pool.ListJobs(ctx, db, pool.ListJobsParams{Queue: "q", Kind: "a", State: pool.StateAvailable, BeforeID: before, Limit: 3})
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 || pages > 5 {
			break
		}
		for _, j := range page {
			got = append(got, j.ID)
		}
		before = page[len(page)-1].ID
	}
	if !slices.Equal(got, want) {
		t.Fatalf("pages visited %v, want %v", got, want)
	}
	if bs, err := pool.ListJobs(ctx, db, pool.ListJobsParams{Kind: "b"}); err != nil || len(bs) != 3 || bs[0].Queue != "other" {
		t.Fatalf("kind b: %+v, %v", bs, err)
	}
	if none, err := pool.ListJobs(ctx, db, pool.ListJobsParams{State: pool.StateFailed}); err != nil || len(none) != 0 {
		t.Fatalf("failed jobs: %+v, %v", none, err)
	}
	for _, p := range []pool.ListJobsParams{{Limit: pool.ListLimitMax + 1}, {Limit: -1}, {State: "done"}, {BeforeID: -1}} {
		if _, err := pool.ListJobs(ctx, db, p); err == nil {
			t.Errorf("ListJobs(%+v) accepted", p)
		}
	}
	if _, err := pool.ListJobs(ctx, db, pool.ListJobsParams{Limit: pool.ListLimitMax}); err != nil {
		t.Errorf("the largest limit: %v", err)
	}
}

// RevokeJob cancels a queued job at once; RecentFailures lists failed jobs; ReadStatus counts
// finished jobs only when asked to.
func TestRevokeStatusAndFailures(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	id, err := pool.Insert(ctx, db, "a", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Insert(ctx, db, "a", nil, nil); err != nil {
		t.Fatal(err)
	}
	st, err := pool.ReadStatus(ctx, db, pool.StatusParams{})
	if err != nil || st.OldestWaiting == nil || st.OldestWaiting.ID != id || len(st.Running) != 0 {
		t.Fatalf("status %+v: %v", st, err)
	}
	if ok, err := pool.RevokeJob(ctx, db, id, "wrong customer"); err != nil || !ok {
		t.Fatalf("revoke: %v %v", ok, err)
	}
	if ok, err := pool.RevokeJob(ctx, db, id, ""); err != nil || ok {
		t.Fatalf("revoke a finished job: %v %v", ok, err)
	}
	j, err := pool.GetJob(ctx, db, id)
	if err != nil || j.State != pool.StateCancelled || j.RevokeReason != "wrong customer" || j.RevokedAt == nil {
		t.Fatalf("revoked job %+v: %v", j, err)
	}
	mustExec(t, db, `UPDATE leash.jobs SET state = 'failed', finished_at = now(), last_error = 'boom' WHERE id <> $1`, id)
	fails, err := pool.RecentFailures(ctx, db, 0)
	if err != nil || len(fails) != 1 || fails[0].LastError != "boom" {
		t.Fatalf("failures %+v: %v", fails, err)
	}
	counts := func(p pool.StatusParams) map[string]int64 {
		t.Helper()
		st, err := pool.ReadStatus(ctx, db, p)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]int64{}
		for _, c := range st.Counts {
			m[c.State] += c.Count
		}
		return m
	}
	if live := counts(pool.StatusParams{}); len(live) != 0 {
		t.Fatalf("live counts include finished jobs: %v", live)
	}
	if all := counts(pool.StatusParams{CountFinished: true}); all[pool.StateCancelled] != 1 || all[pool.StateFailed] != 1 {
		t.Fatalf("all counts: %v", all)
	}
	if _, err := pool.ReadStatus(ctx, db, pool.StatusParams{Running: pool.ListLimitMax + 1}); err == nil {
		t.Fatal("a Running limit above ListLimitMax accepted")
	}
}

// ReadSchemaStatus names applied and pending migrations; MigrateWith applies them and gives up
// on a held lock with ErrMigrationLockTimeout, applying nothing.
func TestSchemaStatusAndMigrateWith(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	all := pool.Migrations()
	if len(all) == 0 || all[len(all)-1].Version != pool.SchemaVersion() || !strings.Contains(all[0].SQL, "leash.jobs") {
		t.Fatalf("migrations %v, schema version %d", all, pool.SchemaVersion())
	}
	s, err := pool.ReadSchemaStatus(ctx, db)
	if err != nil || s.Tracked || !s.Behind() || len(s.Pending) != len(all) || s.Pending[0].Name != all[0].Name {
		t.Fatalf("empty database: %+v, %v", s, err)
	}
	done, err := pool.MigrateWith(ctx, db, pool.MigrateOptions{})
	if err != nil || len(done) != len(all) {
		t.Fatalf("migrate: %d applied, %v", len(done), err)
	}
	s, err = pool.ReadSchemaStatus(ctx, db)
	if err != nil || s.Behind() || s.Ahead() || s.Current != pool.SchemaVersion() || len(s.Applied) != len(all) || s.Applied[0].AppliedAt.IsZero() {
		t.Fatalf("migrated: %+v, %v", s, err)
	}

	// A newer release's migration and one of this release's pending; then a transaction holding
	// leash.schema_migrations, which the migrator reads under its lock timeout.
	mustExec(t, db, `DELETE FROM leash.schema_migrations WHERE version = $1`, pool.SchemaVersion())
	mustExec(t, db, `INSERT INTO leash.schema_migrations (version, name) VALUES (9999, '9999_newer')`)
	s, err = pool.ReadSchemaStatus(ctx, db)
	if err != nil || !s.Ahead() || !s.Behind() || len(s.Pending) != 1 || len(s.Unknown) != 1 || s.Unknown[0].Name != "9999_newer" {
		t.Fatalf("pending and newer: %+v, %v", s, err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE leash.schema_migrations IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	done, err = pool.MigrateWith(ctx, db, pool.MigrateOptions{LockTimeout: 50 * time.Millisecond})
	if !errors.Is(err, pool.ErrMigrationLockTimeout) || len(done) != 0 {
		t.Fatalf("migrate under a held lock: %d applied, %v", len(done), err)
	}
	if _, err := pool.MigrateWith(ctx, db, pool.MigrateOptions{LockTimeout: -1}); err == nil {
		t.Fatal("a negative lock timeout accepted")
	}
}

// Connect opens a pool whose sessions carry leash's settings; a server that cannot be reached
// is an error at once.
func TestConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "public"
	db, err := pool.Connect(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var path, tz string
	if err := db.QueryRow(ctx, `SELECT current_setting('search_path'), current_setting('TimeZone')`).Scan(&path, &tz); err != nil {
		t.Fatal(err)
	}
	if path != "pg_catalog, pg_temp" || tz != "UTC" {
		t.Fatalf("session search_path %q, TimeZone %q", path, tz)
	}
	if cfg.ConnConfig.RuntimeParams["search_path"] != "public" {
		t.Fatal("Connect changed its argument")
	}
	bad, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Connect(ctx, bad); err == nil || !strings.Contains(err.Error(), "cannot reach the database") {
		t.Fatalf("unreachable server: %v", err)
	}
}
