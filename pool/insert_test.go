package pool_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// With the id sequence behind the table (as after a restore), a unique insert with a free key is
// an error naming the primary key, never a duplicate; a batch inserts nothing and says so.
func TestUniqueInsertPrimaryKeyConflict(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	insertMany(t, db, "default", "k", 100)
	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('leash.jobs', 'id'), 1)`); err != nil {
		t.Fatal(err)
	}
	pkConflict := func(what string, err error) {
		t.Helper()
		var pe *pgconn.PgError
		if err == nil || errors.Is(err, pool.ErrDuplicate) || !errors.As(err, &pe) || pe.ConstraintName != "jobs_pkey" ||
			!strings.Contains(err.Error(), "sequence") {
			t.Errorf("%s: %v; want an error naming the primary key and its sequence", what, err)
		}
	}
	_, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{UniqueKey: "free"})
	pkConflict("Insert with a free key", err)
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		_, err := pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{UniqueKey: "free-tx"})
		return err
	})
	pkConflict("InsertTx with a free key", err)

	batches := map[string][]pool.InsertManyParams{
		"free keys": {
			{Kind: "k", Opts: &pool.InsertOpts{UniqueKey: "m1"}},
			{Kind: "k", Opts: &pool.InsertOpts{UniqueKey: "m2"}},
			{Kind: "k", Opts: &pool.InsertOpts{UniqueKey: "m3"}},
		},
		"no keys (COPY)":        {{Kind: "k"}, {Kind: "k"}, {Kind: "k"}},
		"scheduled, no keys":    {{Kind: "k", Opts: &pool.InsertOpts{Delay: time.Hour}}, {Kind: "k"}, {Kind: "k"}},
		"a free key and others": {{Kind: "k"}, {Kind: "k", Opts: &pool.InsertOpts{UniqueKey: "m4"}}, {Kind: "k"}},
	}
	for name, jobs := range batches {
		n, err := pool.InsertMany(ctx, db, jobs)
		pkConflict("InsertMany, "+name, err)
		if n != 0 || err == nil || !strings.Contains(err.Error(), "nothing") {
			t.Errorf("InsertMany, %s: %d inserted, %v; want 0 and an error saying nothing was inserted", name, n, err)
		}
	}
	if n := count(t, db, `SELECT count(*) FROM leash.jobs`); n != 100 {
		t.Fatalf("%d jobs after the failed inserts; want the 100 there were", n)
	}
	// Once the sequence is set right, the same inserts go in.
	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('leash.jobs', 'id'), max(id)) FROM leash.jobs`); err != nil {
		t.Fatal(err)
	}
	if n, err := pool.InsertMany(ctx, db, batches["free keys"]); n != 3 || err != nil {
		t.Fatalf("InsertMany after setval: %d, %v", n, err)
	}
}

// A duplicate leaves the caller's transaction usable under every isolation level: with the holder
// visible in the transaction's snapshot the error names it; with a holder committed after the
// snapshot (REPEATABLE READ, SERIALIZABLE) it matches ErrDuplicateNotVisible too and has no id.
func TestInsertTxDuplicateUnderIsolation(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			prefix := strings.ReplaceAll(string(iso), " ", "-") + ":"
			before := insert(t, db, "k", nil, &pool.InsertOpts{UniqueKey: prefix + "before"})
			tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `SELECT count(*) FROM leash.jobs`); err != nil { // takes the snapshot
				t.Fatal(err)
			}
			after := insert(t, db, "k", nil, &pool.InsertOpts{UniqueKey: prefix + "after"})

			var de *pool.DuplicateError
			id, err := pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{UniqueKey: prefix + "before"})
			if !errors.As(err, &de) || de.ID != before || id != before || errors.Is(err, pool.ErrDuplicateNotVisible) {
				t.Fatalf("key held by a job in the snapshot: %d, %v; want a duplicate of %d", id, err, before)
			}
			id, err = pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{UniqueKey: prefix + "after"})
			if iso == pgx.ReadCommitted {
				if !errors.As(err, &de) || de.ID != after || id != after {
					t.Fatalf("key held by a job committed since: %d, %v; want a duplicate of %d", id, err, after)
				}
			} else if !errors.Is(err, pool.ErrDuplicate) || !errors.Is(err, pool.ErrDuplicateNotVisible) || !errors.As(err, &de) || de.ID != 0 || id != 0 {
				t.Fatalf("key held by a job committed after the snapshot: %d, %v; want ErrDuplicateNotVisible", id, err)
			}
			n, err := pool.InsertMany(ctx, tx, []pool.InsertManyParams{
				{Kind: "k", Opts: &pool.InsertOpts{UniqueKey: prefix + "many"}},
				{Kind: "k", Opts: &pool.InsertOpts{UniqueKey: prefix + "after"}},
			})
			if iso == pgx.ReadCommitted {
				if n != 1 || err != nil {
					t.Fatalf("InsertMany with a held key: %d, %v; want 1 inserted", n, err)
				}
			} else if n != 0 || !errors.Is(err, pool.ErrDuplicateNotVisible) || !strings.Contains(err.Error(), "nothing") {
				t.Fatalf("InsertMany with a key held after the snapshot: %d, %v; want ErrDuplicateNotVisible", n, err)
			}
			if _, err := pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{UniqueKey: prefix + "fresh"}); err != nil {
				t.Fatalf("insert after the duplicates: %v", err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("commit after the duplicates: %v", err)
			}
			if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE unique_key = $1`, prefix+"fresh"); n != 1 {
				t.Fatalf("the job inserted after the duplicates: %d rows", n)
			}
		})
	}
}

// Inserts mean the same on a session whose search_path puts a hostile schema before pg_catalog:
// a now() an hour behind and a text equality that is never true change nothing.
func TestInsertHostileSearchPath(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	setupDB := pgtest.PoolFor(t, url)
	ctx := context.Background()
	if _, err := setupDB.Exec(ctx, `
		CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql
			AS $$ SELECT pg_catalog.now() - interval '1 hour' $$;
		CREATE FUNCTION public.never_equal(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT false $$;
		CREATE OPERATOR public.= (FUNCTION = public.never_equal, LEFTARG = text, RIGHTARG = text);
		DO $$ BEGIN EXECUTE format('ALTER ROLE CURRENT_USER IN DATABASE %I SET search_path = public, pg_catalog',
			current_database()); END $$`); err != nil {
		t.Fatal(err)
	}
	db := pgtest.PoolFor(t, url)
	var hostile bool
	if err := db.QueryRow(ctx, `SELECT now() < pg_catalog.now() - interval '59 minutes' AND NOT ('a' = 'a')`).Scan(&hostile); err != nil || !hostile {
		t.Fatalf("the hostile search_path is not in effect: %v, %v", hostile, err)
	}

	// run_at minus created_at (the column's default, which names pg_catalog.now() by oid).
	lag := func(id int64) time.Duration {
		var ms float64
		if err := setupDB.QueryRow(ctx, `SELECT extract(epoch FROM run_at - created_at) * 1000 FROM leash.jobs WHERE id = $1`, id).Scan(&ms); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ms) * time.Millisecond
	}
	near := func(what string, got, want time.Duration) {
		t.Helper()
		if got < want-5*time.Second || got > want+5*time.Second {
			t.Errorf("%s: run_at is %s after created_at; want about %s", what, got, want)
		}
	}
	near("Insert", lag(insert(t, db, "k", nil, nil)), 0)
	near("Insert with a delay", lag(insert(t, db, "k", nil, &pool.InsertOpts{Delay: time.Minute})), time.Minute)
	keyed := insert(t, db, "k", nil, &pool.InsertOpts{UniqueKey: "hostile", Delay: time.Minute})
	near("Insert with a key and a delay", lag(keyed), time.Minute)
	var inTx int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		inTx, err = pool.InsertTx(ctx, tx, "k", nil, &pool.InsertOpts{UniqueKey: "hostile-tx", Delay: time.Minute})
		return err
	})
	if err != nil {
		t.Fatalf("InsertTx: %v", err)
	}
	near("InsertTx with a key and a delay", lag(inTx), time.Minute)
	id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{UniqueKey: "hostile"})
	if !errors.Is(err, pool.ErrDuplicate) || id != keyed {
		t.Fatalf("insert of a held key: %d, %v; want a duplicate of %d", id, err, keyed)
	}

	// A job that finished 40 minutes ago is outside a 30-minute window.
	old := insert(t, setupDB, "k", nil, &pool.InsertOpts{UniqueKey: "window"})
	if _, err := setupDB.Exec(ctx, `UPDATE leash.jobs SET state = 'completed', finished_at = now() - interval '40 minutes' WHERE id = $1`, old); err != nil {
		t.Fatal(err)
	}
	if id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{UniqueKey: "window", UniqueFinishedWithin: 30 * time.Minute}); err != nil || id == old {
		t.Fatalf("insert past the window: %d, %v; want a new job", id, err)
	}
	if id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{UniqueKey: "window", UniqueFinishedWithin: 30 * time.Minute}); !errors.Is(err, pool.ErrDuplicate) {
		t.Fatalf("insert of a key held now: %d, %v; want a duplicate", id, err)
	}

	for name, jobs := range map[string][]pool.InsertManyParams{
		"COPY, scheduled": {{Kind: "many-copy", Opts: &pool.InsertOpts{Delay: time.Minute}}, {Kind: "many-copy", Opts: &pool.InsertOpts{Delay: time.Minute}}},
		"unique keys": {{Kind: "many-keys", Opts: &pool.InsertOpts{UniqueKey: "mk1", Delay: time.Minute}},
			{Kind: "many-keys", Opts: &pool.InsertOpts{UniqueKey: "hostile", Delay: time.Minute}},
			{Kind: "many-keys", Opts: &pool.InsertOpts{UniqueKey: "mk1", Delay: time.Minute}}},
	} {
		want := int64(2) // two COPY rows; one new key of three (one held, one repeated)
		if jobs[0].Opts.UniqueKey != "" {
			want = 1
		}
		n, err := pool.InsertMany(ctx, db, jobs)
		if err != nil || n != want {
			t.Errorf("InsertMany, %s: %d, %v", name, n, err)
			continue
		}
		rows, err := setupDB.Query(ctx, `SELECT id FROM leash.jobs WHERE kind = $1`, jobs[0].Kind)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(ids) == 0 {
			t.Fatalf("InsertMany, %s: rows %v, %v", name, ids, err)
		}
		for _, id := range ids {
			near(fmt.Sprintf("InsertMany, %s, job %d", name, id), lag(id), time.Minute)
		}
	}
}

// On a pool whose sessions default to REPEATABLE READ, an insert that waited for a concurrent
// transaction inserting the same key gets 40001 from ON CONFLICT once that one commits; the
// statement was a transaction of its own, so the insert tries again and reports the duplicate.
func TestInsertWaitsForConcurrentHolderOnRepeatableReadPool(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	setupDB := pgtest.PoolFor(t, url)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	db, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	holder, err := setupDB.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	held, err := pool.InsertTx(ctx, holder, "k", nil, &pool.InsertOpts{UniqueKey: "contended"})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		id  int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{UniqueKey: "contended"})
		done <- result{id, err}
	}()
	waitFor(t, 10*time.Second, func() bool {
		return count(t, setupDB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO leash.jobs%'`) == 1
	})
	if err := holder.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	var de *pool.DuplicateError
	if !errors.As(r.err, &de) || de.ID != held || de.NotVisible || r.id != held {
		t.Fatalf("insert behind a concurrent holder: %d, %v; want a duplicate of %d", r.id, r.err, held)
	}
}
