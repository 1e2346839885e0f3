package store_test

import (
	"context"
	"testing"
	"testing/fstest"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Migration numbers need not be consecutive: branches reserve numbers and land in any order. A
// database that applied 1, 2, 3 and 6 (from a release without 4 and 5) gets 4 and 5 from a later
// release, and until then that release sees them missing and 6 known.
func TestMigrationGapsAreFilledLater(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	file := func(sql string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(sql)} }
	early := fstest.MapFS{
		"001_a.sql": file("CREATE TABLE leash.t (a int)"),
		"002_b.sql": file("ALTER TABLE leash.t ADD COLUMN b int"),
		"003_c.sql": file("ALTER TABLE leash.t ADD COLUMN c int"),
		"006_f.sql": file("ALTER TABLE leash.t ADD COLUMN f int"),
	}
	later := fstest.MapFS{
		"004_d.sql": file("ALTER TABLE leash.t ADD COLUMN d int"),
		"005_e.sql": file("ALTER TABLE leash.t ADD COLUMN e int"),
	}
	for name, f := range early {
		later[name] = f
	}
	db := pgtest.PoolFor(t, pgtest.EmptyURL(t))
	ms, err := store.MigrationsFrom(early)
	if err != nil {
		t.Fatal(err)
	}
	applied, err := store.ApplyMigrations(ctx, db, ms)
	if got := versions(applied, migVersion); err != nil || len(got) != 4 || got[3] != 6 {
		t.Fatalf("early: %v, %v", got, err)
	}
	ms, err = store.MigrationsFrom(later)
	if err != nil {
		t.Fatal(err)
	}
	applied, err = store.ApplyMigrations(ctx, db, ms)
	if got := versions(applied, migVersion); err != nil || len(got) != 2 || got[0] != 4 || got[1] != 5 {
		t.Fatalf("later: %v, %v", got, err)
	}
	var cols int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = 'leash' AND table_name = 't'`).Scan(&cols); err != nil || cols != 6 {
		t.Fatalf("%d columns, %v", cols, err)
	}
}
