package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

func TestTmpBenchLike(t *testing.T) {
	db := pgtest.Pool(t)
	ctx := context.Background()
	nk := 100000
	execAll(t, db, `SELECT leash.set_queue_max_running_per_key('default', 1)`,
		`INSERT INTO leash.jobs (queue, kind, concurrency_key) SELECT 'default', 'noop', 'tenant-' || k FROM generate_series(1, 3) i, generate_series(1, 100000) k`)
	for taken := 0; taken < nk/2; {
		taken += len(claimKeyed(t, db, "default", min(1000, nk/2-taken), false))
	}
	for {
		var w int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes WHERE key <> ''`).Scan(&w)
		if w == 0 {
			break
		}
		claimKeyed(t, db, "default", 0, false)
	}
	execAll(t, db, `VACUUM ANALYZE leash.jobs`, `VACUUM ANALYZE leash.concurrency_keys`)
	for round := range 3 {
		b := time.Now()
		for range 50 {
			claimKeyed(t, db, "default", 10, false)
		}
		t.Logf("round %d: %v per claim", round, time.Since(b)/50)
	}
	tx, _ := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	tx.Exec(ctx, store.LockQueueRowSQL, "default", "m")
	for _, q := range []string{store.KeyWakesSQL, store.ClaimKeyedSQL, store.KeyWalkedSQL} {
		var args []any
		switch q {
		case store.KeyWakesSQL:
			args = []any{"default", "m", 1000}
		case store.ClaimKeyedSQL:
			args = []any{"default", 10, "w", 60000, "m", false}
		default:
			args = []any{"default", "m", 10}
		}
		rows, _ := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+q, args...)
		for rows.Next() {
			var l string
			rows.Scan(&l)
			t.Log(l)
		}
		rows.Close()
	}
	tx.Rollback(ctx)
}
