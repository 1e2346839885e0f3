package pool_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgcluster"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/notify"
	"github.com/leashq/leash/pool"
)

// ownCluster starts a migrated PostgreSQL of the test's own (for settings that are the whole
// server's) and returns it with a pool on it.
func ownCluster(t *testing.T, settings ...string) (*pgcluster.Cluster, *pgxpool.Pool) {
	t.Helper()
	c, err := pgcluster.Start(context.Background(), settings...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	db := poolOf(t, c.URL("postgres"), 8)
	if _, err := pool.Migrate(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	return c, db
}

// A worker given a standby first in a multi-host URL, without target_session_attrs: its control
// connections and its listener refuse the standby and work on the primary, which the URL names
// second.
func TestWorkerRefusesAStandbyInItsURL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, direct := ownCluster(t)
	standby, err := pgcluster.StartStandby(ctx, primary, "standby")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable", standby.Port, primary.Port)
	// The application's pool goes wherever the URL leads (the standby): the handler writes nothing.
	p, b := setup(t, poolOf(t, url, 4), fastConfig(), map[string]pool.Handler{
		"noop": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })})
	id := insert(t, direct, "noop", nil, nil)
	start(t, p)
	b.events.wait(t, 1, 20*time.Second)
	if r := getRow(t, direct, id); r.State != "completed" {
		t.Fatalf("job %+v", r)
	}
	eventually(t, 10*time.Second, "the listener on the primary", func() bool {
		var n int
		direct.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, notify.ApplicationName).Scan(&n)
		return n == 1 && p.ListenerConnected()
	})
}

// The promoted standby that kept the old primary's synchronous_standby_names, with no standby of
// its own: every commit waits forever, and every statement of the worker times out. Ready names
// the setting and the fix while it lasts, and the worker goes on by itself once it is reset.
func TestReadyNamesCommitsWaitingForASynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db := ownCluster(t, "synchronous_commit = on")
	id := insert(t, db, "noop", nil, nil)
	exec := func(sql string) {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
			t.Fatal(err)
		}
	}
	exec(`ALTER SYSTEM SET synchronous_standby_names = 'gone'`)
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = 4*time.Second, 500*time.Millisecond
	p, b := setup(t, poolOf(t, db.Config().ConnString(), 4), cfg, map[string]pool.Handler{
		"noop": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })})
	start(t, p)
	eventually(t, 30*time.Second, "Ready to name synchronous_standby_names", func() bool {
		err := p.Ready()
		return errors.Is(err, pool.ErrDatabaseSettings) && strings.Contains(err.Error(), "synchronous_standby_names")
	})
	exec(`ALTER SYSTEM RESET synchronous_standby_names`)
	b.events.wait(t, 1, 20*time.Second)
	eventually(t, 20*time.Second, "the job completed and the worker ready", func() bool {
		return getRow(t, db, id).State == "completed" && p.Ready() == nil
	})
}

// A connection on a server that a failover manager fenced read-only (ALTER SYSTEM SET
// default_transaction_read_only and a reload) is closed, not handed out again.
func TestDropReadOnlyClosesFencedConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db := ownCluster(t)
	cfg, err := pgxpool.ParseConfig(db.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	store.DropReadOnly(cfg)
	fenced, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fenced.Close)
	var pid int
	if err := fenced.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{`ALTER SYSTEM SET default_transaction_read_only = on`, `SELECT pg_reload_conf()`} {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		db.Exec(ctx, `ALTER SYSTEM RESET default_transaction_read_only`)
		db.Exec(ctx, `SELECT pg_reload_conf()`)
	})
	// The reload reaches the session between statements; the statement after it brings the
	// server's report of the new default.
	eventually(t, 10*time.Second, "the session to see the read-only default", func() bool {
		c, err := fenced.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		var ro string
		c.QueryRow(ctx, `SHOW transaction_read_only`).Scan(&ro)
		return ro == "on"
	})
	// The next acquire destroys it, and refuses a new connection to the same server.
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if c, err := fenced.Acquire(actx); err == nil {
		c.Release()
		t.Fatal("a connection to a server fenced read-only was handed out")
	}
	eventually(t, 10*time.Second, "the fenced connection closed", func() bool {
		var alive int
		db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&alive)
		return alive == 0 && fenced.Stat().TotalConns() == 0
	})
}
