package pool_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

// readmeGrants returns the GRANT lines of docs/sql.md (section Privileges) for the example role name,
// each with the role's name replaced by role.
func readmeGrants(t *testing.T, example, role string) []string {
	t.Helper()
	b, err := os.ReadFile("../docs/sql.md")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "GRANT ") && strings.HasSuffix(line, " TO "+example+";") {
			out = append(out, strings.TrimSuffix(line, example+";")+role)
		}
	}
	if len(out) == 0 {
		t.Fatalf("docs/sql.md names no GRANT ... TO %s", example)
	}
	return out
}

// poolAsRole returns a pool on db's database whose every connection (the listener's too) logs in
// as a new role holding only grants (statements with %s for the role's name).
func poolAsRole(t *testing.T, db *pgxpool.Pool, grants ...string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	role := fmt.Sprintf("leash_worker_%d", time.Now().UnixNano()%1e9)
	t.Cleanup(func() {
		db.Exec(ctx, "DROP OWNED BY "+role)
		db.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	for _, sql := range append([]string{"CREATE ROLE " + role + " LOGIN"}, grants...) {
		if _, err := db.Exec(ctx, strings.ReplaceAll(sql, "%s", role)); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	cfg := db.Config().Copy()
	cfg.ConnConfig.User, cfg.ConnConfig.Password = role, "" // the test cluster trusts local connections
	cfg.MaxConns = 12
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	var current string
	if err := p.QueryRow(ctx, "SELECT current_user").Scan(&current); err != nil || current != role {
		t.Fatalf("pool acts as %q (%v), want %s", current, err, role)
	}
	return p
}

// A worker of another role than the migrating one, holding exactly the worker grants of docs/sql.md,
// runs everything a worker does without a warning: claims and outcomes, renewals, waiting for
// work and being woken, queue controls, schedules, retention and the planner statistics.
func TestWorkerRoleWithREADMEGrants(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	grants := readmeGrants(t, "leash_worker", "%s")
	as := poolAsRole(t, db, grants...)
	var logs syncbuf.Buffer
	cfg := fastConfig()
	cfg.Engine.WaitAfter = 20 * time.Millisecond
	cfg.PollInterval = 5 * time.Second // wake-ups, not polls, must start the jobs below
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.Schedules = []pool.Schedule{{Name: "tick", Spec: "@every 200ms", Kind: "scheduled"}}
	cfg.PlannerStatsInterval = 50 * time.Millisecond
	cfg.RetainCompleted, cfg.RetentionInterval = time.Millisecond, 50*time.Millisecond
	cfg.RescueInterval = 50 * time.Millisecond
	scheduled := make(chan struct{}, 100)
	ran := make(chan int64, 100)
	p, _ := setup(t, as, cfg, map[string]pool.Handler{
		"noop": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			time.Sleep(300 * time.Millisecond) // a few renewals
			ran <- j.ID
			return nil
		}),
		"scheduled": pool.HandlerFunc(func(context.Context, *pool.Job) error {
			select {
			case scheduled <- struct{}{}:
			default:
			}
			return nil
		}),
	})
	for range 3 {
		insert(t, db, "noop", nil, nil)
	}
	start(t, p)
	select {
	case <-scheduled:
	case <-time.After(10 * time.Second):
		t.Fatalf("no scheduled job ran:\n%s", logs.String())
	}
	// The handlers report, not the rows: retention deletes each finished job within 50ms, so
	// the three completed rows need never stand together.
	for range 3 {
		select {
		case <-ran:
		case <-time.After(10 * time.Second):
			t.Fatalf("the inserted jobs did not all run:\n%s", logs.String())
		}
	}
	// Idle: registered as waiting, and woken by an insert well before the poll.
	waitFor(t, 10*time.Second, func() bool {
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.waiters WHERE expires_at > now()`).Scan(&n)
		return n == 1
	})
	if _, err := pool.PauseQueue(ctx, db, "default"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.ResumeQueue(ctx, db, "default"); err != nil {
		t.Fatal(err)
	}
	id := insert(t, db, "noop", nil, nil)
	for got := int64(0); got != id; {
		select {
		case got = <-ran:
		case <-time.After(3 * time.Second):
			t.Fatal("an insert did not wake the waiting worker")
		}
	}
	waitFor(t, 10*time.Second, func() bool { // retention deleted the finished jobs
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE kind = 'noop'`).Scan(&n)
		return n == 0
	})
	if s := logs.String(); strings.Contains(s, "level=WARN") || strings.Contains(s, "level=ERROR") {
		t.Fatalf("the worker of docs/sql.md's grants logged warnings:\n%s", s)
	}
}
