package store_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// pause_queue, resume_queue and retry_job run with the owner's rights: a role that was only
// allowed to revoke jobs cannot call them.
func TestControlFunctionsNeedGrants(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	role := fmt.Sprintf("leash_op_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	if _, err := db.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s; GRANT USAGE ON SCHEMA leash TO %s;
		GRANT EXECUTE ON FUNCTION leash.revoke_job(bigint, text) TO %s`, role, role, role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		db.Exec(context.Background(), fmt.Sprintf(`REVOKE ALL ON SCHEMA leash FROM %s; REVOKE ALL ON FUNCTION leash.revoke_job(bigint, text) FROM %s; DROP ROLE %s`, role, role, role))
	})
	for _, call := range []string{`SELECT leash.pause_queue('default')`, `SELECT leash.resume_queue('default')`, `SELECT leash.retry_job(1)`} {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+role); err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, call)
		tx.Rollback(ctx)
		if err == nil {
			t.Errorf("%s succeeded for a role without EXECUTE", call)
		}
	}
}

// Running a no-transaction migration again (after a later statement of it failed) keeps the
// indexes it built: a valid unique index is never dropped, not even for a moment.
func TestRerunKeepsValidIndexes(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	oid := func(name string) uint32 {
		var o uint32
		if err := db.QueryRow(ctx, `SELECT to_regclass($1)::oid`, name).Scan(&o); err != nil {
			t.Fatal(err)
		}
		return o
	}
	names := []string{"leash.jobs_unique_key_idx", "leash.jobs_unique_key_finished_idx", "leash.jobs_running_queue_idx"}
	before := map[string]uint32{}
	for _, n := range names {
		before[n] = oid(n)
	}
	if _, err := db.Exec(ctx, `DELETE FROM leash.schema_migrations WHERE version IN (4, 5)`); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if o := oid(n); o == 0 || o != before[n] {
			t.Errorf("%s was rebuilt or dropped by the second run (oid %d, was %d)", n, o, before[n])
		}
	}
	// An invalid leftover (a build cut short) is replaced by a valid index.
	if _, err := db.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'leash.jobs_unique_key_idx'::regclass`); err != nil {
		t.Fatal(err)
	}
	db.Exec(ctx, `DELETE FROM leash.schema_migrations WHERE version = 5`)
	if _, err := store.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	var valid bool
	if err := db.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = 'leash.jobs_unique_key_idx'::regclass`).Scan(&valid); err != nil || !valid {
		t.Fatalf("unique index after rebuilding an invalid one: valid %v, %v", valid, err)
	}
}
