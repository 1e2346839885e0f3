package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/pool"
)

func TestVersion(t *testing.T) {
	t.Parallel()
	out, err := runCmd(t, envOf(), "version")
	// A test binary records no VCS revision: `go test` builds without VCS stamping.
	want := fmt.Sprintf("worker v%s\nrevision unknown\nschema version %d\n", pool.Release, pool.SchemaVersion())
	if err != nil || out != want {
		t.Fatalf("version: %q, %v; want %q", out, err, want)
	}
	if !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(pool.Release) || pool.SchemaVersion() < 3 {
		t.Fatalf("release %q, schema version %d", pool.Release, pool.SchemaVersion())
	}
}

// firstReleaseSchema leaves url's database as the first release's `worker migrate` did: migration
// 1 applied and recorded, nothing else.
func firstReleaseSchema(t *testing.T, url string) {
	t.Helper()
	all := pool.Migrations()
	db := pgtest.PoolFor(t, url)
	_, err := db.Exec(context.Background(), `CREATE SCHEMA leash;
		CREATE TABLE leash.schema_migrations (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
		INSERT INTO leash.schema_migrations (version, name) VALUES (1, '001_jobs');`+all[0].SQL)
	if err != nil {
		t.Fatal(err)
	}
}

// A worker refuses a database that lacks migrations it needs, naming both versions and the fix;
// `migrate -status` lists what is applied and pending; `migrate` prints what it applied.
func TestSchemaCheckAtStart(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	env := envOf("DATABASE_URL", url)
	expected := pool.SchemaVersion()

	_, err := runCmd(t, env, "run")
	if err == nil || !strings.Contains(err.Error(), "leash.schema_migrations does not exist") || !strings.Contains(err.Error(), "run `worker migrate`") {
		t.Fatalf("run on an empty database: %v", err)
	}
	out, err := runCmd(t, env, "migrate", "-status")
	if err != nil || !strings.Contains(out, "applied:  none (leash.schema_migrations does not exist)") ||
		!regexp.MustCompile(`(?m)^\s+1\s+001_jobs`).MatchString(out) || !strings.Contains(out, fmt.Sprintf("schema is at version 0; this worker (release %s) needs %d", pool.Release, expected)) {
		t.Fatalf("status of an empty database: %v\n%s", err, out)
	}

	firstReleaseSchema(t, url)
	_, err = runCmd(t, env, "run")
	want := fmt.Sprintf("database schema is at version 1, this worker needs %d: run `worker migrate`", expected)
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "002_guarantees") {
		t.Fatalf("run on the first release's schema: %v; want %q", err, want)
	}
	out, err = runCmd(t, env, "migrate", "-status")
	applied := regexp.MustCompile(`(?m)^applied:\n +1 +001_jobs +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\npending:\n +2 +002_guarantees\s*\n +3 +003_wakeups`)
	if err != nil || !applied.MatchString(out) {
		t.Fatalf("status of the first release's schema: %v\n%s", err, out)
	}
	out, err = runCmd(t, env, "migrate")
	if err != nil || !strings.HasPrefix(out, "applied 2 002_guarantees\napplied 3 003_wakeups\n") || !strings.Contains(out, fmt.Sprintf("schema is at version %d\n", expected)) {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	out, err = runCmd(t, env, "migrate", "-status")
	if err != nil || !strings.Contains(out, "pending:  none") || !strings.Contains(out, fmt.Sprintf("schema is at version %d, as this worker", expected)) {
		t.Fatalf("status after migrate: %v\n%s", err, out)
	}
	if _, err := runCmd(t, env, "migrate", "extra"); err == nil {
		t.Fatal("migrate accepted an argument")
	}
}

// WORKER_AUTO_MIGRATE=true applies what the worker needs, and says so.
func TestAutoMigrate(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	firstReleaseSchema(t, url)
	logs, port := inProcess(t, url, "WORKER_AUTO_MIGRATE", "true", "WORKER_HTTP_ADDR", "127.0.0.1:0")
	for _, want := range []string{`"msg":"applied migration (WORKER_AUTO_MIGRATE)","version":2,"name":"002_guarantees"`, `"version":3,"name":"003_wakeups"`} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("log lacks %s:\n%s", want, logs.String())
		}
	}
	if code, body := readyWhenListening(t, port); code != 200 || body != "ready\n" {
		t.Fatalf("readyz: %d %q", code, body)
	}
}

func readyz(t *testing.T, port string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://127.0.0.1:" + port + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// readyWhenListening asks /readyz once the worker's listener is connected.
func readyWhenListening(t *testing.T, port string) (code int, body string) {
	t.Helper()
	poll(t, 20*time.Second, "the listener to connect", func() bool {
		code, body = readyz(t, port)
		return body != "listener not connected\n"
	})
	return code, body
}

// A worker older than the schema (still running after a newer release migrated the database)
// warns at start and keeps working; /readyz stays 200 and says so, naming the versions.
func TestWorkerOlderThanSchema(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	newer := pool.SchemaVersion() + 1
	db.Exec(ctx, "INSERT INTO leash.schema_migrations (version, name) VALUES ($1, 'from_a_newer_release')", newer)
	logs, port := inProcess(t, url, "WORKER_HTTP_ADDR", "127.0.0.1:0")
	note := fmt.Sprintf("worker is older than the database schema: schema at version %d, this worker (release %s) knows up to %d",
		newer, pool.Release, pool.SchemaVersion())
	if !strings.Contains(logs.String(), `"level":"WARN","msg":"`+note) {
		t.Fatalf("no warning at start:\n%s", logs.String())
	}
	code, body := readyWhenListening(t, port)
	if code != 200 || !strings.HasPrefix(body, "ready\n") || !strings.Contains(body, note) {
		t.Fatalf("readyz: %d %q", code, body)
	}
	var id int64
	db.QueryRow(ctx, `INSERT INTO leash.jobs (kind) VALUES ('noop') RETURNING id`).Scan(&id)
	poll(t, 20*time.Second, "the job to complete", func() bool {
		var state string
		db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&state)
		return state == "completed"
	})
	out, err := runCmd(t, envOf("DATABASE_URL", url), "migrate", "-status")
	if err != nil || !strings.Contains(out, "not known to this worker (applied by a newer release)") || !strings.Contains(out, "upgrade the worker") {
		t.Fatalf("status: %v\n%s", err, out)
	}
	out, err = runCmd(t, envOf("DATABASE_URL", url), "migrate")
	if err != nil || !strings.Contains(out, "nothing to apply") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
}

// A migration does not wait behind a long transaction (the fleet's queries would queue behind
// it): it gives up after -lock-timeout, applies nothing of that attempt, and tries again.
func TestMigrateGivesWayToLongTransactions(t *testing.T) {
	t.Parallel()
	url := pgtest.EmptyURL(t)
	firstReleaseSchema(t, url)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	env := envOf("DATABASE_URL", url)
	hold := func() func() {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT count(*) FROM leash.jobs"); err != nil { // ACCESS SHARE until the end
			t.Fatal(err)
		}
		return func() { tx.Rollback(ctx) }
	}

	release := hold()
	started := time.Now()
	_, err := runCmd(t, env, "migrate", "-lock-timeout", "100ms", "-retry-for", "0")
	if err == nil || !strings.Contains(err.Error(), "longer than the lock timeout (100ms)") || time.Since(started) > 10*time.Second {
		t.Fatalf("migrate behind a long transaction: %v after %s", err, time.Since(started))
	}
	if out, _ := runCmd(t, env, "migrate", "-status"); !strings.Contains(out, "schema is at version 1;") {
		t.Fatalf("a migration that gave up left:\n%s", out)
	}

	release()
	release2 := hold()
	go func() { time.Sleep(time.Second); release2() }()
	out, err := runCmd(t, env, "migrate", "-lock-timeout", "100ms", "-retry-for", "1m")
	if err != nil || !strings.Contains(out, "was not granted within 100ms") || !strings.Contains(out, "applied 3 003_wakeups") {
		t.Fatalf("migrate after the transaction ended: %v\n%s", err, out)
	}
}
