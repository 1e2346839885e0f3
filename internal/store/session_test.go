package store_test

import (
	"context"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Every function in schema leash resolves names with a search_path of its own, whoever calls
// it: the released ones through migration 011, later ones by being written so.
func TestEveryLeashFunctionPinsSearchPath(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	rows, err := db.Query(context.Background(), `
		SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = 'leash'::regnamespace
		  AND NOT EXISTS (SELECT FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	unpinned, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(unpinned) > 0 {
		t.Fatalf("functions in schema leash without SET search_path: %v", unpinned)
	}
	var n int
	db.QueryRow(context.Background(), `SELECT count(*) FROM pg_proc WHERE pronamespace = 'leash'::regnamespace`).Scan(&n)
	if n < 10 {
		t.Fatalf("only %d functions in schema leash: the query looks in the wrong place", n)
	}
}

// A database's defaults, as a DBA sets them, do not reach a session PinSession pinned.
func TestPinSessionOverridesDatabaseDefaults(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	dbName := pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()
	pgtest.Exec(t, url, `ALTER DATABASE `+dbName+` SET search_path = public, pg_catalog;
		ALTER DATABASE `+dbName+` SET default_transaction_isolation = 'repeatable read';
		ALTER DATABASE `+dbName+` SET idle_session_timeout = '5s';
		ALTER DATABASE `+dbName+` SET idle_in_transaction_session_timeout = '1s';
		ALTER DATABASE `+dbName+` SET statement_timeout = '2s';
		ALTER DATABASE `+dbName+` SET lock_timeout = '1s';
		ALTER DATABASE `+dbName+` SET synchronous_commit = off;
		ALTER DATABASE `+dbName+` SET "TimeZone" = 'Asia/Kathmandu'`)
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(url + "&search_path=elsewhere")
	if err != nil {
		t.Fatal(err)
	}
	show := func(cfg *pgx.ConnConfig) map[string]string {
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		got := map[string]string{}
		for _, name := range []string{"search_path", "default_transaction_isolation", "idle_session_timeout",
			"idle_in_transaction_session_timeout", "statement_timeout", "lock_timeout", "synchronous_commit", "TimeZone"} {
			var v string
			if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err != nil {
				t.Fatal(err)
			}
			got[name] = v
		}
		s, err := store.ReadSession(ctx, conn)
		if err != nil {
			t.Fatal(err)
		}
		got["unsafe"] = ""
		for _, st := range s.Unsafe() {
			got["unsafe"] += st.Name + " "
		}
		return got
	}
	if got := show(cfg); got["statement_timeout"] != "2s" || got["synchronous_commit"] != "off" ||
		got["unsafe"] != "default_transaction_isolation statement_timeout lock_timeout idle_session_timeout synchronous_commit " {
		t.Fatalf("unpinned session does not see the database's settings: %v", got)
	}
	store.PinSession(&cfg.Config)
	want := map[string]string{"search_path": "pg_catalog, pg_temp", "default_transaction_isolation": "read committed",
		"idle_session_timeout": "0", "idle_in_transaction_session_timeout": "1min", "statement_timeout": "0",
		"lock_timeout": "0", "synchronous_commit": "on", "TimeZone": "UTC", "unsafe": ""}
	got := show(cfg)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("pinned %s = %q, want %q", k, got[k], v)
		}
	}
	// A stronger synchronous_commit is kept.
	pgtest.Exec(t, url, `ALTER DATABASE `+dbName+` SET synchronous_commit = remote_apply`)
	if got := show(cfg); got["synchronous_commit"] != "remote_apply" {
		t.Errorf("remote_apply became %q", got["synchronous_commit"])
	}
}

// search_path = public, pg_catalog on the database, and someone who may create in public has put
// an hour-late now() and a recording pg_notify(text, text) there: leash's trigger functions, run
// by any inserting session, use neither.
func TestTriggerFunctionsIgnoreTheCallersSearchPath(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	dbName := pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()
	pgtest.Exec(t, url, `CREATE TABLE public.calls (fn text);
		GRANT INSERT ON public.calls TO PUBLIC;
		CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_catalog.now() - interval '1 hour' $$;
		CREATE FUNCTION public.pg_notify(text, text) RETURNS void LANGUAGE sql
			AS $$ INSERT INTO public.calls VALUES ('pg_notify ' || $1); SELECT pg_catalog.pg_notify($1, $2) $$;
		ALTER DATABASE `+dbName+` SET search_path = public, pg_catalog`)
	ctx := context.Background()
	pinned := func() *pgx.Conn {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		store.PinSession(&cfg.Config)
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(ctx) })
		return conn
	}
	listener, worker := pinned(), pinned()
	if _, err := listener.Exec(ctx, "LISTEN job_available; LISTEN job_revoked; LISTEN test_done"); err != nil {
		t.Fatal(err)
	}
	if err := store.RegisterWaiter(ctx, worker, "test", []string{"a"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var sp string
	conn.QueryRow(ctx, "SHOW search_path").Scan(&sp)
	if sp != "public, pg_catalog" {
		t.Fatalf("search_path %q", sp)
	}
	// A plain SQL insert, with the table's default run_at (pg_catalog.now, bound when the table
	// was made).
	if _, err := conn.Exec(ctx, `INSERT INTO leash.jobs (kind, queue) VALUES ('k', 'a')`); err != nil {
		t.Fatal(err)
	}
	// A revocation of a running job notifies through leash.notify_revoked.
	if _, err := conn.Exec(ctx, `INSERT INTO leash.jobs (kind, queue, state, lease_token, leased_by, lease_expires_at)
		VALUES ('k', 'b', 'running', 1, 'w', pg_catalog.now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `UPDATE leash.jobs SET revoked_at = pg_catalog.now() WHERE queue = 'b'`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "NOTIFY test_done"); err != nil {
		t.Fatal(err)
	}
	var got []string
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("waiting for notifications: %v (got %v)", err, got)
		}
		if n.Channel == "test_done" {
			break
		}
		got = append(got, n.Channel+" "+n.Payload)
	}
	if len(got) != 2 {
		t.Fatalf("notifications %v, want the insert's and the revocation's", got)
	}
	var calls []string
	rows, _ := pgtest.PoolFor(t, url).Query(context.Background(), "SELECT fn FROM public.calls")
	calls, _ = pgx.CollectRows(rows, pgx.RowTo[string])
	if len(calls) > 0 {
		t.Fatalf("leash's functions called public's: %v", calls)
	}
}

// Migrations bind PostgreSQL's names, whatever search_path the database sets: a column default
// made while public.now() is an hour late is pg_catalog.now().
func TestMigrationsIgnoreTheDatabasesSearchPath(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	dbName := pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()
	pgtest.Exec(t, url, `CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_catalog.now() - interval '1 hour' $$;
		ALTER DATABASE `+dbName+` SET search_path = public, pg_catalog`)
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	if _, err := store.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	var late bool
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (kind) VALUES ('k') RETURNING run_at < pg_catalog.now() - interval '30 minutes'`).Scan(&late); err != nil {
		t.Fatal(err)
	}
	if late {
		t.Fatal("leash.jobs.run_at defaults to public.now()")
	}
}

// A statement_timeout on the role bounds no migration statement; only ApplyOptions.LockTimeout
// bounds waits for locks, and the session's own settings are back afterwards.
func TestMigrationsIgnoreTheRolesStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.EmptyURL(t)
	role, roleURL := pgtest.Role(t, url, "SUPERUSER")
	pgtest.Exec(t, url, `CREATE TABLE public.t (a int);
		ALTER ROLE `+role+` SET statement_timeout = '100ms'; ALTER ROLE `+role+` SET lock_timeout = '50ms'`)
	ms, err := store.MigrationsFrom(fstest.MapFS{
		"001_slow.sql": {Data: []byte("CREATE SCHEMA IF NOT EXISTS leash; LOCK TABLE public.t IN SHARE MODE; SELECT pg_sleep(0.3);")},
		"002_slow.sql": {Data: []byte("-- leash:no-transaction\nSELECT pg_sleep(0.3);\nSELECT 1;")},
	})
	if err != nil {
		t.Fatal(err)
	}
	db := pgtest.PoolFor(t, roleURL)
	var st string
	db.QueryRow(ctx, "SHOW statement_timeout").Scan(&st)
	if st != "100ms" {
		t.Fatalf("the role's statement_timeout is %q", st)
	}
	// Another session holds a lock the first migration waits for, longer than both timeouts.
	holder, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(ctx)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE public.t IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	time.AfterFunc(300*time.Millisecond, func() { tx.Rollback(ctx); close(released) })
	applied, err := store.ApplyMigrationsWith(ctx, db, ms, store.ApplyOptions{LockTimeout: 5 * time.Second})
	<-released
	if err != nil {
		t.Fatalf("migrations under the role's statement_timeout: %v", err)
	}
	if len(applied) != 2 || !applied[1].NoTransaction {
		t.Fatalf("applied %v, want both, the second outside a transaction", applied)
	}
	for _, name := range []string{"statement_timeout", "lock_timeout"} {
		db.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&st)
		if want := map[string]string{"statement_timeout": "100ms", "lock_timeout": "50ms"}[name]; st != want {
			t.Fatalf("%s after migrating: %q, want the role's %q", name, st, want)
		}
	}
}
