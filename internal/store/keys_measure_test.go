package store_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// TestExplainKeyedClaim prints, by hand, the plans of the statements of a claim of a queue with a
// per-key limit on many keys: LEASH_KEYS=100000 go test ./internal/store -run ExplainKeyedClaim -v.
// The queue has that many keys of 3 jobs each, half of them at their limit of 1 (their first job
// running); beside it, an uncapped queue of as many jobs without a key, claimed by the claim of
// uncapped queues for comparison. Each statement runs under EXPLAIN (ANALYZE, BUFFERS) in a
// transaction rolled back afterwards, the best of five.
func TestExplainKeyedClaim(t *testing.T) {
	keys, _ := strconv.Atoi(os.Getenv("LEASH_KEYS"))
	if keys <= 0 {
		t.Skip("set LEASH_KEYS (e.g. 100000) to explain the claim of a queue with many keys")
	}
	ctx := context.Background()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		`INSERT INTO leash.queues (name) VALUES ('plain')`,
		fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind, concurrency_key, created_at, run_at)
		 SELECT 'kq', 'w', 'tenant-' || k, now() - interval '1 hour', now() - interval '1 hour' + k * interval '1 ms'
		 FROM generate_series(1, %d) k, generate_series(1, 3) i`, keys),
		fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind) SELECT 'plain', 'w' FROM generate_series(1, %d)`, keys*3),
		`VACUUM ANALYZE leash.jobs`)
	// Every key gets its row: the first claims work off the wakes of the inserts.
	for {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.key_wakes WHERE key <> ''`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		mark := "m"
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, store.LockQueueRowSQL, "kq", mark); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, store.KeyWakesSQL, "kq", mark, 1_000_000); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Half the keys at their limit: claim them (the keys first in order) and leave them running.
	for claimed := 0; claimed < keys/2; {
		jobs := claimKeyed(t, db, "kq", min(1000, keys/2-claimed), false)
		claimed += len(jobs)
	}
	execAll(t, db, `VACUUM ANALYZE leash.jobs`, `VACUUM ANALYZE leash.concurrency_keys`, `VACUUM ANALYZE leash.key_wakes`)
	var rows int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.concurrency_keys WHERE queue = 'kq'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys, %d with a row in leash.concurrency_keys", keys, rows)
	const uncapped = "claim of 10 jobs of an uncapped queue"
	explain := func(name, sql string, args ...any) {
		best := time.Duration(1 << 62)
		var plan string
		for range 5 {
			tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
			if err != nil {
				t.Fatal(err)
			}
			if name != uncapped {
				if _, err := tx.Exec(ctx, store.LockQueueRowSQL, "kq", "m"); err != nil {
					t.Fatal(err)
				}
			}
			if strings.HasPrefix(name, "generic: ") {
				if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
					t.Fatal(err)
				}
			}
			rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+sql, args...)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			var lines []string
			for rows.Next() {
				var l string
				if err := rows.Scan(&l); err != nil {
					t.Fatal(err)
				}
				lines = append(lines, l)
			}
			rows.Close()
			tx.Rollback(ctx)
			var ms float64
			for _, l := range lines {
				if strings.HasPrefix(l, "Execution Time:") {
					fmt.Sscanf(strings.TrimPrefix(l, "Execution Time:"), "%f", &ms)
				}
			}
			if d := time.Duration(ms * float64(time.Millisecond)); d < best {
				best, plan = d, strings.Join(lines, "\n")
			}
		}
		t.Logf("%s: best %v\n%s", name, best, plan)
	}
	explain("claim of 10 jobs of the queue with a per-key limit", store.ClaimKeyedSQL, "kq", 10, "w", 60000, "m", false)
	explain("the same, looking for jobs without a key too", store.ClaimKeyedSQL, "kq", 10, "w", 60000, "m", true)
	explain("walked keys brought up to date", store.KeyWalkedSQL, "kq", "m", 10)
	explain("woken keys brought up to date (none woken)", store.KeyWakesSQL, "kq", "m", 1000)
	explain("generic: claim", store.ClaimKeyedSQL, "kq", 10, "w", 60000, "m", false)
	explain("generic: walked", store.KeyWalkedSQL, "kq", "m", 10)
	explain("generic: wakes", store.KeyWakesSQL, "kq", "m", 1000)
	explain(uncapped, store.ClaimOneSQL, "plain", 10, "w", 60000)
}
