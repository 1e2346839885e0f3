package store_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// TestKeyUseReadsIndexesOnly explains the read of a queue's keys (store.ReadKeyUse) on a queue of
// many keys (LEASH_KEYS, 5,000 unless set; 100,000 to measure), 3 jobs each, half of them at their
// limit of 1: it reaches the jobs through the partial indexes of migration 025 and the keys
// through leash.concurrency_keys, never by a scan of leash.jobs, and reads a bounded number of
// index entries whatever the number of keys. With -v it prints the plan.
func TestKeyUseReadsIndexesOnly(t *testing.T) {
	t.Parallel()
	keys := 5000
	if n, _ := strconv.Atoi(os.Getenv("LEASH_KEYS")); n > 0 {
		keys = n
	}
	ctx := context.Background()
	db := pgtest.Pool(t)
	execAll(t, db,
		`SELECT leash.set_queue_max_running_per_key('kq', 1)`,
		fmt.Sprintf(`INSERT INTO leash.jobs (queue, kind, concurrency_key)
		 SELECT 'kq', 'w', 'tenant-' || k FROM generate_series(1, %d) k, generate_series(1, 3) i`, keys),
		// The first job of every odd key runs: those keys are at their limit.
		`UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(), leased_by = 'w',
		   lease_token = id, lease_expires_at = now() + interval '1 hour'
		 WHERE id IN (SELECT min(id) FROM leash.jobs GROUP BY concurrency_key)
		   AND substring(concurrency_key FROM 8)::int % 2 = 1`,
		// The even keys are next in line, as a claim leaves them.
		`INSERT INTO leash.concurrency_keys (queue, key, next_priority, next_run_at, next_id)
		 SELECT 'kq', concurrency_key, 1, min(run_at), min(id) FROM leash.jobs
		 WHERE substring(concurrency_key FROM 8)::int % 2 = 0 GROUP BY concurrency_key`,
		`VACUUM ANALYZE leash.jobs`, `VACUUM ANALYZE leash.concurrency_keys`)

	var plan strings.Builder
	rows, err := db.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) `+store.KeyUseSQL, "kq", 100, 1000)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan.WriteString(line + "\n")
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys:\n%s", keys, plan.String())
	for _, bad := range []string{"Seq Scan", "Bitmap Heap Scan on jobs"} {
		if strings.Contains(plan.String(), bad) {
			t.Errorf("the plan has a %s", bad)
		}
	}

	uses, err := store.ReadKeyUse(ctx, db, "kq", 100, 1000)
	if err != nil {
		t.Fatal(err)
	}
	atLimit, waiting := 0, 0
	for _, u := range uses {
		if u.Holders >= 1 {
			atLimit++
			if u.Waiting != 2 {
				t.Errorf("key %s at its limit: %d waiting; want 2", u.Key, u.Waiting)
			}
		} else {
			waiting++
			if u.Waiting != 3 {
				t.Errorf("key %s with room: %d waiting; want 3", u.Key, u.Waiting)
			}
		}
	}
	if atLimit < 100 || waiting < 100 || len(uses) > 300 {
		t.Fatalf("%d keys at their limit and %d next in line; want at least 100 each of at most 300 keys", atLimit, waiting)
	}
}
