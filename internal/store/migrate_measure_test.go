package store_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// The first release's claim, as its workers run it on an upgraded database.
const claimV1 = `
	WITH picked AS (
		SELECT id FROM leash.jobs
		WHERE state IN ('available', 'retryable') AND queue = $1 AND run_at <= now()
		ORDER BY priority, run_at, id
		LIMIT $2
		FOR UPDATE SKIP LOCKED
	)
	UPDATE leash.jobs j
	SET state = 'running', attempt = j.attempt + 1, lease_token = nextval('leash.lease_tokens'),
	    leased_by = $3, lease_expires_at = now() + interval '30 seconds',
	    heartbeat_at = now(), attempted_at = now()
	FROM picked
	WHERE j.id = picked.id
	RETURNING j.id, j.lease_token`

// latencies records how long statements took, by the time they started.
type latencies struct {
	mu  sync.Mutex
	obs []obs
}

type obs struct {
	start time.Time
	took  time.Duration
}

func (l *latencies) add(start time.Time) {
	l.mu.Lock()
	l.obs = append(l.obs, obs{start, time.Since(start)})
	l.mu.Unlock()
}

// during returns the count and the longest of the statements that overlapped [from, to].
func (l *latencies) during(from, to time.Time) (n int, longest time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range l.obs {
		if o.start.Before(to) && o.start.Add(o.took).After(from) {
			n++
			longest = max(longest, o.took)
		}
	}
	return n, longest
}

// TestMeasureMigrationsOnLargeTable measures, by hand, what applying this release's migrations
// costs a live fleet: LEASH_MIGRATION_ROWS=3000000 go test ./internal/store -run
// MeasureMigrations -v -timeout 30m. It loads a first-release schema with that many jobs (mostly
// finished, some queued), keeps two first-release claimers (claim ten, complete them) and a
// producer (one insert every 5 ms) running, and applies each later migration in one transaction,
// statement by statement: the time of each statement, the locks the transaction holds before its
// commit, and the longest claim and insert that overlapped it. Then it repeats the first
// migration after it while a transaction holds one job row locked for 3 s (a handler in
// job.Fence), to show the lock queue, and again with a lock_timeout of 500 ms, as `worker
// migrate -lock-timeout` sets.
func TestMeasureMigrationsOnLargeTable(t *testing.T) {
	rowsWanted, _ := strconv.Atoi(os.Getenv("LEASH_MIGRATION_ROWS"))
	if rowsWanted <= 0 {
		t.Skip("a measurement run by hand: set LEASH_MIGRATION_ROWS (e.g. 3000000)")
	}
	ctx := context.Background()
	all, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	for _, scenario := range []string{"free", "row locked 3s", "row locked 3s, lock_timeout 500ms"} {
		url := pgtest.EmptyURL(t)
		db := pgtest.PoolFor(t, url)
		if _, err := store.ApplyMigrations(ctx, db, all[:1]); err != nil {
			t.Fatal(err)
		}
		loadStart := time.Now()
		queued := max(rowsWanted/30, 1000)
		for done := 0; done < rowsWanted-queued; {
			n := min(500_000, rowsWanted-queued-done)
			if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, payload, state, attempt, created_at, attempted_at, finished_at)
				SELECT 'noop', jsonb_build_object('n', i), 'completed', 1, now(), now(), now() FROM generate_series(1, $1) i`, n); err != nil {
				t.Fatal(err)
			}
			done += n
		}
		db.Exec(ctx, `INSERT INTO leash.jobs (kind, payload) SELECT 'noop', jsonb_build_object('n', i) FROM generate_series(1, $1) i`, queued)
		// Revoked while running, then put back by a failing attempt: what 002's UPDATE repairs.
		db.Exec(ctx, `INSERT INTO leash.jobs (kind, state, revoked_at, run_at) SELECT 'noop', 'retryable', now(), now() + interval '1 day' FROM generate_series(1, 100)`)
		db.Exec(ctx, "VACUUM ANALYZE leash.jobs")
		var size string
		db.QueryRow(ctx, "SELECT pg_size_pretty(pg_total_relation_size('leash.jobs'))").Scan(&size)
		t.Logf("[%s] loaded %d jobs (%d queued) in %s; leash.jobs with indexes: %s", scenario, rowsWanted, queued, time.Since(loadStart).Round(time.Second), size)

		// The fleet: two first-release claimers and a producer.
		var claims, inserts latencies
		var claimed atomic.Int64
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 2 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					start := time.Now()
					rows, _ := db.Query(ctx, claimV1, "default", 10, fmt.Sprintf("w%d", w))
					type claim struct{ ID, Token int64 }
					got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[claim])
					if err != nil {
						t.Errorf("claim: %v", err)
						return
					}
					for _, c := range got {
						if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'completed', finished_at = now(), lease_token = NULL,
							leased_by = NULL, lease_expires_at = NULL WHERE id = $1 AND lease_token = $2`, c.ID, c.Token); err != nil {
							t.Errorf("complete: %v", err)
							return
						}
					}
					claims.add(start)
					claimed.Add(int64(len(got)))
				}
			})
		}
		wg.Go(func() {
			tick := time.NewTicker(5 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				start := time.Now()
				if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind) VALUES ('noop')`); err != nil {
					t.Errorf("insert: %v", err)
					return
				}
				inserts.add(start)
			}
		})
		time.Sleep(2 * time.Second)
		_, base := claims.during(time.Now().Add(-time.Second), time.Now())
		_, baseIns := inserts.during(time.Now().Add(-time.Second), time.Now())
		t.Logf("[%s] before migrating: longest claim+complete %s, longest insert %s (last second)", scenario, base.Round(time.Microsecond), baseIns.Round(time.Microsecond))

		var holder pgx.Tx
		if scenario != "free" {
			if holder, err = db.Begin(ctx); err != nil {
				t.Fatal(err)
			}
			holder.Exec(ctx, "SELECT id FROM leash.jobs WHERE state = 'completed' ORDER BY id LIMIT 1 FOR UPDATE")
			go func() { time.Sleep(3 * time.Second); holder.Rollback(ctx) }()
		}
		for _, m := range all[1:] {
			lockTimeout := ""
			if strings.Contains(scenario, "lock_timeout") {
				lockTimeout = "500ms"
			}
			measureMigration(t, ctx, db, scenario, m, lockTimeout, &claims, &inserts)
			time.Sleep(time.Second)
			if scenario != "free" {
				break
			}
		}
		close(stop)
		wg.Wait()
		t.Logf("[%s] %d jobs claimed meanwhile", scenario, claimed.Load())
	}
}

func measureMigration(t *testing.T, ctx context.Context, db *pgxpool.Pool, scenario string, m store.Migration, lockTimeout string, claims, inserts *latencies) {
	t.Helper()
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	start := time.Now()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if lockTimeout != "" {
		tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", lockTimeout)
	}
	var steps []string
	for _, stmt := range store.SplitStatements(m.SQL) {
		s := time.Now()
		if _, err := tx.Exec(ctx, stmt); err != nil {
			if store.IsLockTimeout(err) {
				tx.Rollback(ctx)
				end := time.Now()
				time.Sleep(300 * time.Millisecond)
				nc, longest := claims.during(start, end)
				ni, longestIns := inserts.during(start, end)
				t.Logf("[%s] %s: gave up after %s (%v); meanwhile %d claim+complete rounds, longest %s; %d inserts, longest %s",
					scenario, m.Name, end.Sub(start).Round(10*time.Microsecond), err, nc, longest.Round(10*time.Microsecond), ni, longestIns.Round(10*time.Microsecond))
				return
			}
			t.Fatalf("%s: %v\n%s", m.Name, err, stmt)
		}
		first := strings.Fields(stripLeadingComments(stmt))
		steps = append(steps, fmt.Sprintf("%s %s", strings.Join(first[:min(4, len(first))], " "), time.Since(s).Round(10*time.Microsecond)))
	}
	rows, _ := tx.Query(ctx, `SELECT coalesce(c.relname, l.locktype), l.mode FROM pg_locks l LEFT JOIN pg_class c ON c.oid = l.relation
		WHERE l.pid = pg_backend_pid() AND l.granted AND (c.relnamespace = 'leash'::regnamespace OR c.oid IS NULL)
		AND l.locktype IN ('relation', 'object')`)
	locks, _ := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var rel, mode string
		err := r.Scan(&rel, &mode)
		return rel + ":" + mode, err
	})
	slices.Sort(locks)
	locks = slices.Compact(locks)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	end := time.Now()
	time.Sleep(300 * time.Millisecond) // let the statements that waited finish
	nc, longest := claims.during(start, end)
	ni, longestIns := inserts.during(start, end)
	t.Logf("[%s] %s: %s in one transaction; statements: %s", scenario, m.Name, end.Sub(start).Round(10*time.Microsecond), strings.Join(steps, "; "))
	t.Logf("[%s] %s: locks on leash objects held until commit: %s", scenario, m.Name, strings.Join(locks, ", "))
	t.Logf("[%s] %s: meanwhile %d claim+complete rounds, longest %s; %d inserts, longest %s", scenario, m.Name,
		nc, longest.Round(10*time.Microsecond), ni, longestIns.Round(10*time.Microsecond))
}

func stripLeadingComments(s string) string {
	for {
		s = strings.TrimSpace(s)
		if !strings.HasPrefix(s, "--") {
			return s
		}
		if i := strings.IndexByte(s, '\n'); i >= 0 {
			s = s[i+1:]
		} else {
			return ""
		}
	}
}
