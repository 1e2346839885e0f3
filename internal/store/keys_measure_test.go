package store_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// TestExplainKeyedClaim prints, by hand, the plans of the statements of a claim of a queue with a
// per-key limit on many keys: LEASH_KEYS=100000 go test ./internal/store -run ExplainKeyedClaim -v.
// The queue has that many keys of 3 jobs each, half of them at their limit of 1 (their first job
// running); beside it, an uncapped queue of as many jobs without a key, claimed by the claim of
// uncapped queues for comparison. auto_explain (ANALYZE, BUFFERS) logs every statement the claims
// run, those of the claim's functions included, on the plans they run on; the last claim's are
// printed, and the mean time of a claim (auto_explain's timing included).
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
		claimKeyed(t, db, "kq", 0, false)
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
	url := db.Config().ConnConfig.ConnString()
	conn, plans := explainedConn(t, url, true)
	timed := func(name string, claim func() error) {
		began := time.Now()
		const n = 50
		for range n {
			if err := claim(); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("%s: %v a claim (mean of %d, with auto_explain)", name, time.Since(began)/n, n)
	}
	keyed := func(unkeyed bool) func() error {
		return func() error {
			_, _, err := store.ClaimKeyed(ctx, conn, store.KeyedParams{Unkeyed: unkeyed,
				ClaimParams: store.ClaimParams{Queues: []string{"kq"}, Limit: 10, WorkerID: "w", Lease: time.Hour}})
			return err
		}
	}
	uncapped := func() error {
		_, err := store.Claim(ctx, conn, store.ClaimParams{Queues: []string{"plain"}, Limit: 10, WorkerID: "w", Lease: time.Hour})
		return err
	}
	timed("claim of 10 jobs of the queue with a per-key limit", keyed(false))
	t.Logf("its statements, the last claim's:\n%s", strings.Join(lastClaim(plans()), "\n\n"))
	timed("the same, looking for jobs without a key too", keyed(true))
	t.Logf("its statements, the last claim's:\n%s", strings.Join(lastClaim(plans()), "\n\n"))
	timed("claim of 10 jobs of an uncapped queue", uncapped)
	t.Logf("its statements, the last claim's:\n%s", strings.Join(lastClaim(plans()), "\n\n"))
}

// lastClaim is the plans of the last claim among plans: from its lock of the queue's row (or
// its one statement) on.
func lastClaim(plans []string) []string {
	for i := len(plans) - 1; i >= 0; i-- {
		if strings.Contains(plans[i], "set_config('leash.capped_claim'") {
			return plans[i:]
		}
	}
	if len(plans) > 0 {
		return plans[len(plans)-1:]
	}
	return nil
}
