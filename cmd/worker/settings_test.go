package main

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
)

// `worker run` on a database a DBA made read-only refuses at start, naming the setting and the
// fix, before it claims anything.
func TestRunRefusesAReadOnlyDatabase(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()
	pgtest.Exec(t, url, "INSERT INTO leash.jobs (kind) VALUES ('noop'); ALTER DATABASE "+db+" SET default_transaction_read_only = on")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := run(ctx, []string{"run"}, envOf("DATABASE_URL", url, "LOG_FORMAT", "json"), io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "default_transaction_read_only = on") ||
		!strings.Contains(err.Error(), "ALTER DATABASE "+db+" RESET default_transaction_read_only") {
		t.Fatalf("run: %v", err)
	}
}

// /readyz, and `worker health` on it, say why while a setting stops the worker (here a role's
// connection limit lowered under it), and are ready again once it is undone.
func TestReadyzNamesTheSettingThatStopsTheWorker(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	role, roleURL := pgtest.Role(t, url, "")
	_, port := inProcess(t, roleURL, "WORKER_HTTP_ADDR", "127.0.0.1:0", "WORKER_LEASE_DURATION", "2s", "WORKER_HEARTBEAT_INTERVAL", "500ms")
	if code, body := readyWhenListening(t, port); code != 200 {
		t.Fatalf("readyz: %d %q", code, body)
	}
	pgtest.Exec(t, url, "ALTER ROLE "+role+" CONNECTION LIMIT 5")
	var body string
	poll(t, 10*time.Second, "not ready", func() bool {
		var code int
		code, body = readyz(t, port)
		return code == 503
	})
	if !strings.Contains(body, "CONNECTION LIMIT of role "+role+" = 5") {
		t.Fatalf("readyz: %q", body)
	}
	if _, err := runCmd(t, envOf(), "health", "-url", "http://127.0.0.1:"+port+"/readyz"); err == nil || !strings.Contains(err.Error(), "CONNECTION LIMIT") {
		t.Fatalf("health: %v", err)
	}
	pgtest.Exec(t, url, "ALTER ROLE "+role+" CONNECTION LIMIT -1")
	poll(t, 10*time.Second, "ready again", func() bool {
		code, _ := readyz(t, port)
		return code == 200
	})
}

// `worker migrate` under a database's statement_timeout shorter than its lock timeout still
// gives way to a long transaction and retries, rather than failing on the statement timeout.
func TestMigrateUnderTheDatabasesStatementTimeout(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	firstReleaseSchema(t, url)
	pgtest.Exec(t, url, "ALTER DATABASE "+pgx.Identifier{pgtest.DatabaseName(t, url)}.Sanitize()+" SET statement_timeout = '100ms'")
	ctx := context.Background()
	db := pgtest.PoolFor(t, url)
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT count(*) FROM leash.jobs"); err != nil { // ACCESS SHARE until the end
		t.Fatal(err)
	}
	released := make(chan struct{})
	time.AfterFunc(time.Second, func() { tx.Rollback(ctx); close(released) })
	out, err := runCmd(t, envOf("DATABASE_URL", url), "migrate", "-lock-timeout", "300ms", "-retry-for", "1m")
	<-released
	if err != nil || !strings.Contains(out, "was not granted within 300ms") || !strings.Contains(out, "applied 3 003_wakeups") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
}
