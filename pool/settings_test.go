package pool_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// poolOf opens a pool on url with at most maxConns connections, closed when t ends.
func poolOf(t *testing.T, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	db, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return db
}

// eventually polls cond (a state no signal reports: another session's change, the listener's
// connection) until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// What leash cannot set on its own connections, set by a DBA on the database or the role, stops
// Run before it claims anything, with an error naming the setting and the fix.
func TestRunRefusesWhatItCannotPin(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		setup   func(t *testing.T, url string) string // returns the URL the worker connects with
		conns   int32
		setting string
		fix     string
	}{
		{"read-only database", func(t *testing.T, url string) string {
			pgtest.Exec(t, url, "ALTER DATABASE "+dbIdent(t, url)+" SET default_transaction_read_only = on")
			return url
		}, 4, "default_transaction_read_only", "ALTER DATABASE " + "%db" + " RESET default_transaction_read_only"},
		{"read-only role", func(t *testing.T, url string) string {
			role, roleURL := pgtest.Role(t, url, "")
			pgtest.Exec(t, url, "ALTER ROLE "+role+" SET default_transaction_read_only = on")
			return roleURL
		}, 4, "default_transaction_read_only", "ALTER ROLE %role RESET default_transaction_read_only"},
		{"triggers off for the role", func(t *testing.T, url string) string {
			role, roleURL := pgtest.Role(t, url, "SUPERUSER")
			pgtest.Exec(t, url, "ALTER ROLE "+role+" IN DATABASE "+dbIdent(t, url)+" SET session_replication_role = replica")
			return roleURL
		}, 4, "session_replication_role", "ALTER ROLE %role IN DATABASE %db RESET session_replication_role"},
		{"role connection limit", func(t *testing.T, url string) string {
			_, roleURL := pgtest.Role(t, url, "CONNECTION LIMIT 6")
			return roleURL
		}, 2, "CONNECTION LIMIT of role", "CONNECTION LIMIT 7"},
		{"database connection limit", func(t *testing.T, url string) string {
			_, roleURL := pgtest.Role(t, url, "")
			pgtest.Exec(t, url, "ALTER DATABASE "+dbIdent(t, url)+" CONNECTION LIMIT 10")
			return roleURL
		}, 8, "CONNECTION LIMIT of database", "CONNECTION LIMIT 13"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			url := pgtest.URL(t)
			workerURL := c.setup(t, url)
			db := poolOf(t, workerURL, c.conns)
			p, err := pool.New(db, fastConfig())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err = p.Run(ctx)
			var se *pool.SettingError
			if !errors.Is(err, pool.ErrDatabaseSettings) || !errors.As(err, &se) {
				t.Fatalf("Run: %v, want a *pool.SettingError", err)
			}
			cfg, _ := pgx.ParseConfig(workerURL)
			fix := strings.NewReplacer("%db", dbIdent(t, url), "%role", pgx.Identifier{cfg.User}.Sanitize()).Replace(c.fix)
			if !strings.HasPrefix(se.Setting, c.setting) || !strings.Contains(se.Fix, fix) {
				t.Fatalf("Run: %v\nwant setting %s and a fix saying %q", err, c.setting, fix)
			}
			if err := p.Ready(); !errors.Is(err, pool.ErrDatabaseSettings) || !strings.Contains(err.Error(), c.setting) {
				t.Fatalf("Ready: %v", err)
			}
			var n int
			db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE state = 'running'").Scan(&n)
			if n != 0 {
				t.Fatalf("%d jobs claimed", n)
			}
		})
	}
}

func dbIdent(t *testing.T, url string) string {
	return pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()
}

// A limit lowered under a running worker makes it not ready while it lasts.
func TestReadyFollowsTheConnectionLimit(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	role, roleURL := pgtest.Role(t, url, "")
	p, _ := setup(t, poolOf(t, roleURL, 4), fastConfig(), nil)
	start(t, p)
	eventually(t, 10*time.Second, "ready", func() bool { return p.Ready() == nil })
	pgtest.Exec(t, url, "ALTER ROLE "+role+" CONNECTION LIMIT 3")
	eventually(t, 10*time.Second, "not ready", func() bool { return errors.Is(p.Ready(), pool.ErrDatabaseSettings) })
	if err := p.Ready(); !strings.Contains(err.Error(), "CONNECTION LIMIT of role "+role+" = 3") {
		t.Fatalf("Ready: %v", err)
	}
	pgtest.Exec(t, url, "ALTER ROLE "+role+" CONNECTION LIMIT -1")
	eventually(t, 10*time.Second, "ready again", func() bool { return p.Ready() == nil })
}

// A listener that loses its connection and gets it back within a reconnect does not make the
// worker unready: a health check built on Ready does not restart a healthy worker.
func TestReadyToleratesAListenerReconnect(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.ListenReconnectDelay = 300 * time.Millisecond
	p, b := setup(t, nil, cfg, nil)
	start(t, p)
	ctx := context.Background()
	eventually(t, 10*time.Second, "ready", func() bool { return p.Ready() == nil })
	if _, err := b.db.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'leash-listener' AND datname = current_database()"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the listener to reconnect", func() bool {
		if err := p.Ready(); err != nil {
			t.Fatalf("not ready during a reconnect: %v", err)
		}
		return p.Stats().Listener.Reconnects > 0 && p.ListenerConnected()
	})
}

// A database whose defaults would break leash, as a DBA sets them (the search_path with a
// writable schema first, where someone put an hour-late now() and a recording pg_notify; repeatable
// read; an idle-session timeout shorter than the listener's silence; no durable commits): the
// worker's connections run with their own settings, claims use the real clock, the listener
// stays connected and the worker stays ready.
func TestWorkerUnderHostileDatabaseDefaults(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	dbName := dbIdent(t, url)
	pgtest.Exec(t, url, `CREATE TABLE public.calls (fn text);
		GRANT INSERT ON public.calls TO PUBLIC;
		CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_catalog.now() - interval '1 hour' $$;
		CREATE FUNCTION public.pg_notify(text, text) RETURNS void LANGUAGE sql
			AS $$ INSERT INTO public.calls VALUES ('pg_notify ' || $1); SELECT pg_catalog.pg_notify($1, $2) $$;
		ALTER DATABASE `+dbName+` SET search_path = public, pg_catalog;
		ALTER DATABASE `+dbName+` SET default_transaction_isolation = 'repeatable read';
		ALTER DATABASE `+dbName+` SET idle_session_timeout = '500ms';
		ALTER DATABASE `+dbName+` SET synchronous_commit = off;
		ALTER DATABASE `+dbName+` SET statement_timeout = '2s'`)
	cfg := fastConfig()
	cfg.ListenPingInterval = 100 * time.Millisecond
	cfg.PollInterval = time.Minute // pickups come from wake-ups, not polling
	p, b := setup(t, pgtest.PoolFor(t, url), cfg, map[string]pool.Handler{"noop": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })})
	start(t, p)
	ctx := context.Background()
	eventually(t, 10*time.Second, "ready", func() bool { return p.Ready() == nil })
	for name, want := range map[string]string{"search_path": "pg_catalog, pg_temp", "default_transaction_isolation": "read committed",
		"idle_session_timeout": "0", "synchronous_commit": "on", "statement_timeout": "0"} {
		var got string
		if err := p.ControlPool().QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil || got != want {
			t.Errorf("control connection: %s = %q (%v), want %q", name, got, err, want)
		}
	}
	// A plain SQL insert (run_at defaults to pg_catalog.now()) is claimed at once, not an hour
	// later, and by a wake-up: the worker registered as waiting on the real clock.
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	eventually(t, 10*time.Second, "the worker to wait for work", func() bool {
		var n int
		admin.QueryRow(ctx, "SELECT count(*) FROM leash.waiters WHERE expires_at > pg_catalog.now()").Scan(&n)
		return n > 0
	})
	if _, err := admin.Exec(ctx, "INSERT INTO leash.jobs (kind) VALUES ('noop')"); err != nil {
		t.Fatal(err)
	}
	if ev := b.events.wait(t, 1, 10*time.Second)[0]; ev.State != "completed" {
		t.Fatalf("job %+v", ev)
	}
	// Twice the idle-session timeout with nothing to do: the listener stays.
	time.Sleep(1200 * time.Millisecond)
	if n := p.Stats().Listener.Reconnects; n != 0 || !p.ListenerConnected() || p.Ready() != nil {
		t.Fatalf("listener reconnected %d times, connected %v, ready %v", n, p.ListenerConnected(), p.Ready())
	}
	rows, _ := admin.Query(ctx, "SELECT fn FROM public.calls")
	calls, _ := pgx.CollectRows(rows, pgx.RowTo[string])
	if len(calls) > 0 {
		t.Fatalf("the worker called public's functions: %v", calls)
	}
}
