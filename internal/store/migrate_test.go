package store_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func versions[T any](ms []T, v func(T) int) []int {
	out := []int{}
	for _, m := range ms {
		out = append(out, v(m))
	}
	return out
}

func migVersion(m store.Migration) int        { return m.Version }
func appVersion(a store.AppliedMigration) int { return a.Version }

// The schema check a worker makes at start: no schema, an older one, the expected one, a newer
// one.
func TestSchemaStatus(t *testing.T) {
	t.Parallel()
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	ctx := context.Background()
	all, err := store.Migrations()
	if err != nil || len(all) < 2 {
		t.Fatalf("migrations: %d, %v", len(all), err)
	}
	expected := store.ExpectedVersion()
	if expected != all[len(all)-1].Version {
		t.Fatalf("expected version %d, newest migration %d", expected, all[len(all)-1].Version)
	}

	c, err := store.CheckSchema(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if c.Tracked || !c.Behind() || c.Ahead() || c.Current != 0 || c.Expected != expected || len(c.Missing) != len(all) {
		t.Fatalf("empty database: %+v", c)
	}
	applied, pending, err := store.SchemaStatus(ctx, db)
	if err != nil || len(applied) != 0 || len(pending) != len(all) {
		t.Fatalf("empty database: applied %v, pending %v, %v", applied, pending, err)
	}

	// The first release's schema only.
	if _, err := store.ApplyMigrations(ctx, db, all[:1]); err != nil {
		t.Fatal(err)
	}
	c, err = store.CheckSchema(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Tracked || !c.Behind() || c.Ahead() || c.Current != all[0].Version ||
		!slices.Equal(versions(c.Missing, migVersion), versions(all[1:], migVersion)) {
		t.Fatalf("first release's schema: %+v", c)
	}

	got, err := store.Apply(ctx, db)
	if err != nil || !slices.Equal(versions(got, migVersion), versions(all[1:], migVersion)) {
		t.Fatalf("apply the rest: %v, %v", versions(got, migVersion), err)
	}
	before := time.Now()
	applied, pending, err = store.SchemaStatus(ctx, db)
	if err != nil || len(pending) != 0 || !slices.Equal(versions(applied, appVersion), versions(all, migVersion)) {
		t.Fatalf("up to date: applied %v, pending %v, %v", applied, pending, err)
	}
	for i, a := range applied {
		if a.Name != all[i].Name || a.AppliedAt.IsZero() || a.AppliedAt.After(before.Add(time.Minute)) || a.AppliedAt.Before(before.Add(-5*time.Minute)) {
			t.Fatalf("applied %+v", a)
		}
	}
	if c, _ = store.CheckSchema(ctx, db); c.Behind() || c.Ahead() || c.Current != expected {
		t.Fatalf("up to date: %+v", c)
	}

	// A newer release migrated the database: this binary is behind, the database is not.
	db.Exec(ctx, "INSERT INTO leash.schema_migrations (version, name) VALUES (999, '999_future')")
	if c, _ = store.CheckSchema(ctx, db); c.Behind() || !c.Ahead() || c.Current != 999 || c.Expected != expected ||
		!slices.Equal(versions(c.Unknown, appVersion), []int{999}) {
		t.Fatalf("newer schema: %+v", c)
	}
	if got, err := store.Apply(ctx, db); err != nil || len(got) != 0 {
		t.Fatalf("migrate on a newer schema: %v, %v", got, err)
	}

	// A hole: a migration this binary needs is missing although later ones are applied.
	db.Exec(ctx, "DELETE FROM leash.schema_migrations WHERE version = $1", all[1].Version)
	if c, _ = store.CheckSchema(ctx, db); !c.Behind() || !slices.Equal(versions(c.Missing, migVersion), []int{all[1].Version}) {
		t.Fatalf("schema with a hole: %+v", c)
	}
}

// The embedded migrations run in the transaction that applies a release's schema whole, except
// those listed here, which build indexes concurrently (docs/operations.md, Upgrading).
func TestEmbeddedMigrationsAreTransactional(t *testing.T) {
	outside := map[string]bool{"004_queues": true, "005_job_features": true, "020_workflows": true, "025_concurrency_keys": true}
	all, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range all {
		if m.NoTransaction != outside[m.Name] {
			t.Errorf("%s: runs outside a transaction = %v: update this test and README's Upgrading section if that is meant", m.Name, m.NoTransaction)
		}
	}
}

const noTxIndexes = `-- test: two indexes built without blocking writes.
-- leash:no-transaction
-- A semicolon in a comment; does not split.
DROP INDEX CONCURRENTLY IF EXISTS leash.t_a_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS t_a_idx ON leash.t (a);
/* a block comment; with /* nesting; */ still a comment; */
CREATE INDEX CONCURRENTLY IF NOT EXISTS t_b_idx ON leash.t (b) WHERE b <> ';';
COMMENT ON TABLE leash.t IS 'semi;colon ''quoted;'' here';
`

func noTxFS(third string) fstest.MapFS {
	return fstest.MapFS{
		"001_t.sql":       {Data: []byte("CREATE TABLE leash.t (a int, b text); INSERT INTO leash.t SELECT i, i::text FROM generate_series(1, 1000) i;")},
		"002_indexes.sql": {Data: []byte(noTxIndexes)},
		"003_more.sql":    {Data: []byte(third)},
	}
}

// A migration marked "-- leash:no-transaction" runs statement by statement outside a
// transaction (CREATE INDEX CONCURRENTLY refuses to run inside one), once however many
// migrators run at once, after the migrations before it committed and before those after it.
func TestNoTransactionMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ms, err := store.MigrationsFrom(noTxFS("ALTER TABLE leash.t ADD COLUMN c int; CREATE FUNCTION leash.f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$;"))
	if err != nil {
		t.Fatal(err)
	}
	if ms[0].NoTransaction || !ms[1].NoTransaction || ms[2].NoTransaction {
		t.Fatalf("markers: %v %v %v", ms[0].NoTransaction, ms[1].NoTransaction, ms[2].NoTransaction)
	}
	url := pgtest.EmptyURL(t)
	db := pgtest.PoolFor(t, url)
	var wg sync.WaitGroup
	results := make([][]store.Migration, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Go(func() {
			if i == 3 { // one migrator on a plain connection
				conn, err := pgx.Connect(ctx, url)
				if err != nil {
					errs[i] = err
					return
				}
				defer conn.Close(ctx)
				results[i], errs[i] = store.ApplyMigrations(ctx, conn, ms)
				return
			}
			results[i], errs[i] = store.ApplyMigrations(ctx, db, ms)
		})
	}
	wg.Wait()
	var all []int
	for i := range 4 {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		all = append(all, versions(results[i], migVersion)...)
	}
	slices.Sort(all)
	if !slices.Equal(all, []int{1, 2, 3}) {
		t.Fatalf("applied across 4 migrators: %v", all)
	}
	var valid int
	db.QueryRow(ctx, `SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE c.relname IN ('t_a_idx', 't_b_idx') AND i.indisvalid`).Scan(&valid)
	var comment string
	db.QueryRow(ctx, `SELECT obj_description('leash.t'::regclass)`).Scan(&comment)
	if valid != 2 || comment != "semi;colon 'quoted;' here" {
		t.Fatalf("%d valid indexes, comment %q", valid, comment)
	}
	// Nobody holds the migration lock afterwards (the session lock was released).
	var held int
	db.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&held)
	if held != 0 {
		t.Fatalf("%d advisory locks held after migrating", held)
	}
	// Inside a transaction it cannot run, and says why.
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	tx.Exec(ctx, "DELETE FROM leash.schema_migrations WHERE version >= 2")
	if _, err := store.ApplyMigrations(ctx, tx, ms); err == nil || !strings.Contains(err.Error(), "outside a transaction") {
		t.Fatalf("from a transaction: %v", err)
	}
}

// A no-transaction migration that fails part-way is not recorded, the transactional ones before
// it stay applied, and the next run repeats it from its first statement.
func TestNoTransactionMigrationFailsAndResumes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	broken := fstest.MapFS{
		"001_t.sql": {Data: []byte("CREATE TABLE leash.t (a int, b text);")},
		"002_indexes.sql": {Data: []byte("-- leash:no-transaction\n" +
			"CREATE INDEX CONCURRENTLY IF NOT EXISTS t_a_idx ON leash.t (a);\n" +
			"CREATE INDEX CONCURRENTLY t_b_idx ON leash.t (no_such_column);\n")},
	}
	ms, err := store.MigrationsFrom(broken)
	if err != nil {
		t.Fatal(err)
	}
	got, err := store.ApplyMigrations(ctx, db, ms)
	if err == nil || !strings.Contains(err.Error(), "002_indexes") || !strings.Contains(err.Error(), "statement 2") {
		t.Fatalf("broken migration: %v", err)
	}
	if !slices.Equal(versions(got, migVersion), []int{1}) {
		t.Fatalf("applied before the failure: %v", versions(got, migVersion))
	}
	ms, err = store.MigrationsFrom(noTxFS("SELECT 1"))
	if err != nil {
		t.Fatal(err)
	}
	ms[0].SQL = "SELECT 1" // already applied; its table lacks the rows of noTxFS's version
	got, err = store.ApplyMigrations(ctx, db, ms)
	if err != nil || !slices.Equal(versions(got, migVersion), []int{2, 3}) {
		t.Fatalf("fixed migration: %v, %v", versions(got, migVersion), err)
	}
}

func TestSplitStatements(t *testing.T) {
	cases := map[string][]string{
		"SELECT 1; SELECT 2":                          {"SELECT 1", "SELECT 2"},
		"SELECT 1;;\n-- only a comment;\n":            {"SELECT 1"},
		"SELECT ';', \"a;b\" FROM x; SELECT 2;":       {"SELECT ';', \"a;b\" FROM x", "SELECT 2"},
		"SELECT 'it''s; fine'; SELECT E'\\'; x'; X":   {"SELECT 'it''s; fine'", "SELECT E'\\'; x'", "X"},
		"CREATE FUNCTION f() AS $$ a; b $$; SELECT 3": {"CREATE FUNCTION f() AS $$ a; b $$", "SELECT 3"},
		"DO $x$ BEGIN PERFORM $$;$$; END $x$; Y":      {"DO $x$ BEGIN PERFORM $$;$$; END $x$", "Y"},
		"SELECT $1; Z":                                {"SELECT $1", "Z"},
		"/* a; /* b; */ c; */ SELECT 4; -- t;":        {"/* a; /* b; */ c; */ SELECT 4", "-- t;"},
		"-- header\n-- leash:no-transaction\n":        nil,
	}
	for in, want := range cases {
		got := store.SplitStatements(in)
		// A trailing comment after the last statement is not a statement.
		if in == "/* a; /* b; */ c; */ SELECT 4; -- t;" {
			want = want[:1]
		}
		if !slices.Equal(got, want) {
			t.Errorf("%q: got %q, want %q", in, got, want)
		}
	}
}

// The marker counts only in the comments that open the file.
func TestNoTransactionMarkerPlacement(t *testing.T) {
	ms, err := store.MigrationsFrom(fstest.MapFS{
		"001_a.sql": {Data: []byte("\n-- about this file\n--   leash:no-transaction\nSELECT 1;\n")},
		"002_b.sql": {Data: []byte("SELECT 1;\n-- leash:no-transaction\nSELECT 2;\n")},
		"003_c.sql": {Data: []byte("-- leash:no-transactions\nSELECT 1;\n")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if ms[0].NoTransaction || ms[1].NoTransaction || ms[2].NoTransaction {
		t.Fatalf("markers: %v %v %v", ms[0].NoTransaction, ms[1].NoTransaction, ms[2].NoTransaction)
	}
	ms, _ = store.MigrationsFrom(fstest.MapFS{"001_a.sql": {Data: []byte("-- about this file\n\n-- leash:no-transaction\nSELECT 1;\n")}})
	if !ms[0].NoTransaction {
		t.Fatal("marker in the header not seen")
	}
	if _, err := store.MigrationsFrom(fstest.MapFS{"001_a.sql": {Data: []byte("-- leash:no-transaction\n-- nothing else\n")}}); err == nil {
		t.Fatal("a no-transaction migration without statements accepted")
	}
}

// With a lock timeout, a migration gives up on a table another transaction holds instead of
// queueing every query on it behind itself, in a transaction or outside one; the session's own
// lock_timeout is left as it was.
func TestMigrationLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.EmptyURL(t)
	db := pgtest.PoolFor(t, url)
	ms, err := store.MigrationsFrom(noTxFS("ALTER TABLE leash.t ADD COLUMN c int"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.ApplyMigrations(ctx, db, ms[:1]); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	conn.Exec(ctx, "SET lock_timeout = '7s'")
	holder, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	holder.Exec(ctx, "LOCK TABLE leash.t IN EXCLUSIVE MODE") // conflicts with CREATE INDEX CONCURRENTLY
	started := time.Now()
	got, err := store.ApplyMigrationsWith(ctx, conn, ms, store.ApplyOptions{LockTimeout: 100 * time.Millisecond})
	if !store.IsLockTimeout(err) || len(got) != 0 || time.Since(started) > 5*time.Second {
		t.Fatalf("outside a transaction: %v, %v after %s", versions(got, migVersion), err, time.Since(started))
	}
	var setting string
	conn.QueryRow(ctx, "SHOW lock_timeout").Scan(&setting)
	if setting != "7s" {
		t.Fatalf("the session's lock_timeout is %q after migrating", setting)
	}
	holder.Rollback(ctx)
	if got, err := store.ApplyMigrationsWith(ctx, conn, ms[:2], store.ApplyOptions{LockTimeout: 100 * time.Millisecond}); err != nil || len(got) != 1 {
		t.Fatalf("once free: %v, %v", versions(got, migVersion), err)
	}

	holder, err = db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	holder.Exec(ctx, "SELECT count(*) FROM leash.t") // conflicts with ALTER TABLE
	got, err = store.ApplyMigrationsWith(ctx, db, ms, store.ApplyOptions{LockTimeout: 100 * time.Millisecond})
	if !store.IsLockTimeout(err) || len(got) != 0 {
		t.Fatalf("in a transaction: %v, %v", versions(got, migVersion), err)
	}
	if c, _ := store.CheckSchema(ctx, db); len(c.Applied) != 2 {
		t.Fatalf("recorded after giving up: %+v", c.Applied)
	}
}

// Versions need not be consecutive: a release may ship 7 before 4 to 6 exist (they are written
// on other branches). The gap applies as is, the versions filled in later apply after it, and
// the schema is reported by what is applied, never by counting.
func TestMigrationVersionGap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	withGap := fstest.MapFS{
		"001_a.sql": {Data: []byte("CREATE TABLE leash.a (x int);")},
		"007_g.sql": {Data: []byte("CREATE TABLE leash.g (x int);")},
	}
	ms, err := store.MigrationsFrom(withGap)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := store.ApplyMigrations(ctx, db, ms); err != nil || !slices.Equal(versions(got, migVersion), []int{1, 7}) {
		t.Fatalf("with a gap: %v, %v", versions(got, migVersion), err)
	}
	withGap["004_d.sql"] = &fstest.MapFile{Data: []byte("CREATE TABLE leash.d (x int);")}
	if ms, err = store.MigrationsFrom(withGap); err != nil {
		t.Fatal(err)
	}
	if got, err := store.ApplyMigrations(ctx, db, ms); err != nil || !slices.Equal(versions(got, migVersion), []int{4}) {
		t.Fatalf("the gap filled in: %v, %v", versions(got, migVersion), err)
	}
	if got, err := store.ApplyMigrations(ctx, db, ms); err != nil || len(got) != 0 {
		t.Fatalf("again: %v, %v", versions(got, migVersion), err)
	}
}
