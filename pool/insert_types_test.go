package pool_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// Inserts run on the application's sessions: with a search_path that puts a schema before
// pg_catalog, the type names their casts spell (jsonb, text[], timestamptz[]) do not resolve to a
// type of that schema, as the functions and operators do not. (A domain named like the built-in
// type, whose check ran a function of that schema, ran it in the inserting session.)
func TestInsertHostileTypeNames(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"jsonb", "text", "timestamptz"} {
		t.Run(typ, func(t *testing.T) {
			t.Parallel()
			url := pgtest.URL(t)
			setupDB := pgtest.PoolFor(t, url)
			ctx := context.Background()
			if _, err := setupDB.Exec(ctx, `
				CREATE TABLE public.spied (n int);
				CREATE FUNCTION public.spy() RETURNS boolean LANGUAGE plpgsql
					AS $$ BEGIN INSERT INTO public.spied VALUES (1); RETURN true; END $$;
				CREATE DOMAIN public.`+typ+` AS pg_catalog.`+typ+` CHECK (public.spy());
				DO $$ BEGIN EXECUTE format('ALTER ROLE CURRENT_USER IN DATABASE %I SET search_path = public, pg_catalog',
					current_database()); END $$`); err != nil {
				t.Fatal(err)
			}
			db := pgtest.PoolFor(t, url)
			payload := map[string]any{"a": 1}
			if _, err := pool.Insert(ctx, db, "k", payload, nil); err != nil {
				t.Logf("Insert: %v", err)
			}
			if _, err := pool.Insert(ctx, db, "k", payload, &pool.InsertOpts{UniqueKey: "u1"}); err != nil {
				t.Logf("Insert with a key: %v", err)
			}
			if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				_, err := pool.InsertTx(ctx, tx, "k", payload, &pool.InsertOpts{UniqueKey: "u2"})
				return err
			}); err != nil {
				t.Logf("InsertTx: %v", err)
			}
			if _, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{
				{Kind: "k", Payload: payload, Opts: &pool.InsertOpts{UniqueKey: "m1"}},
				{Kind: "k", Payload: payload, Opts: &pool.InsertOpts{UniqueKey: "m2"}},
			}); err != nil {
				t.Logf("InsertMany with keys: %v", err)
			}
			var n int
			if err := setupDB.QueryRow(ctx, `SELECT count(*) FROM public.spied`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Fatalf("a domain public.%s's check ran %d times in the inserting session", typ, n)
			}
		})
	}
}
