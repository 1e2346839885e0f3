package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// The generic plans of the renewal, the outcome batch and the read of leases still held (after a
// batch left some outcomes unwritten) read each lease's row once, through
// the primary key, whatever the statistics say of running jobs: taken when none or one ran, or
// never taken. A renewal that joined the table to its arrays was planned, under such
// statistics, as a scan of the running jobs with the whole array scanned again for each of them:
// 4 million rows filtered out to renew 2,000 leases, a cost in the square of the leases. Driven
// by the leases but with the state compared to a constant, it read the running jobs' index for
// each lease instead, at the same cost.
func TestRenewAndFinishPlansAreLinearInLeases(t *testing.T) {
	t.Parallel()
	const leases = 2000
	for _, stats := range []string{"taken when no job ran", "taken when one job ran", "never taken"} {
		t.Run(stats, func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			ctx := context.Background()
			conn, _ := genericPlanConn(t, db) // autovacuum off: the statistics stay as taken
			insert := func(queue string, n int) {
				t.Helper()
				ps := make([]store.InsertParams, n)
				for i := range ps {
					ps[i] = jp(store.InsertParams{Kind: "noop", Queue: queue})
				}
				if _, err := store.InsertMany(ctx, db, ps); err != nil {
					t.Fatal(err)
				}
			}
			claim := func(n int) []store.ClaimedJob {
				t.Helper()
				jobs, err := ensureAndClaim(ctx, db, store.ClaimParams{Queues: []string{"default"}, Limit: n, WorkerID: "w", Lease: time.Minute})
				if err != nil || len(jobs) != n {
					t.Fatalf("claimed %d of %d: %v", len(jobs), n, err)
				}
				return jobs
			}
			if stats != "never taken" {
				insert("elsewhere", 20000)
				if stats == "taken when one job ran" {
					insert("default", 1)
					claim(1)
				}
				if _, err := db.Exec(ctx, "ANALYZE leash.jobs"); err != nil {
					t.Fatal(err)
				}
			}
			insert("default", leases)
			jobs := claim(leases)

			ids, tokens := make([]string, leases), make([]string, leases)
			for i, j := range jobs {
				ids[i], tokens[i] = fmt.Sprint(j.ID), fmt.Sprint(j.Token)
			}
			array := func(s []string) string { return "'{" + strings.Join(s, ",") + "}'" }
			same := func(v string) string {
				s := make([]string, leases)
				for i := range s {
					s[i] = v
				}
				return array(s)
			}
			for _, q := range []string{
				"PREPARE ren(bigint[], bigint[], bigint) AS " + store.RenewSQL,
				"PREPARE fin(bigint[], bigint[], text[], bigint[], boolean[], jsonb[], text[], jsonb[]) AS " + store.FinishSQL,
				"PREPARE com(bigint[], bigint[], jsonb[]) AS " + store.CompleteSQL,
				"PREPARE held(bigint[], bigint[]) AS " + store.StillHeldSQL,
			} {
				if _, err := conn.Exec(ctx, q); err != nil {
					t.Fatal(err)
				}
			}
			for _, s := range []struct {
				name, execute string
				locks         bool // the rows it reads by lease are those it locks
			}{
				{"renewal", "EXECUTE ren(" + array(ids) + ", " + array(tokens) + ", 60000)", true},
				{"outcome batch", "EXECUTE fin(" + array(ids) + ", " + array(tokens) + ", " + same("completed") + ", " + same("0") + ", " +
					same("f") + ", " + same("NULL") + ", " + same("NULL") + ", " + same("NULL") + ")", true},
				{"completion batch", "EXECUTE com(" + array(ids) + ", " + array(tokens) + ", " + same("NULL") + ")", true},
				{"lease read", "EXECUTE held(" + array(ids) + ", " + array(tokens) + ")", false},
			} {
				name := s.name
				plan, ms := explainAnalyzed(t, conn, s.execute)
				if got := plan.ActualRows; got != leases {
					t.Errorf("%s: wrote %.0f of %d rows", name, got, leases)
				}
				var removed float64
				var probes []string
				plan.walk(!s.locks, func(n *planNode, locking bool) {
					removed += (n.RemovedByFilter + n.RemovedByJoinFilter) * n.ActualLoops
					if n.NodeType == "Function Scan" && n.ActualLoops > 1 {
						t.Errorf("%s: the leases' array is scanned %.0f times", name, n.ActualLoops)
					}
					if locking && n.Relation == "jobs" {
						probes = append(probes, fmt.Sprintf("%s %s x%.0f", n.NodeType, n.IndexName, n.ActualLoops))
					}
				})
				if removed > leases {
					t.Errorf("%s: %.0f rows filtered out for %d leases", name, removed, leases)
				}
				if want := fmt.Sprintf("Index Scan jobs_pkey x%d", leases); len(probes) != 1 || probes[0] != want {
					t.Errorf("%s: the rows of the leases are read by %v; want %s", name, probes, want)
				}
				if t.Failed() {
					t.Fatalf("%s, generic plan, %d leases, %.1f ms:\n%s", name, leases, ms, plan.text(0))
				}
				t.Logf("%s: %.1f ms for %d leases", name, ms, leases)
			}
		})
	}
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode struct {
	NodeType            string      `json:"Node Type"`
	Relation            string      `json:"Relation Name"`
	IndexName           string      `json:"Index Name"`
	ActualRows          float64     `json:"Actual Rows"`
	ActualLoops         float64     `json:"Actual Loops"`
	RemovedByFilter     float64     `json:"Rows Removed by Filter"`      // per loop
	RemovedByJoinFilter float64     `json:"Rows Removed by Join Filter"` // per loop
	Plans               []*planNode `json:"Plans"`
}

// walk calls f on n and every node below it, telling it whether the node is below a LockRows.
func (n *planNode) walk(locking bool, f func(n *planNode, locking bool)) {
	f(n, locking)
	for _, c := range n.Plans {
		c.walk(locking || n.NodeType == "LockRows", f)
	}
}

func (n *planNode) text(depth int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s%s %s %s rows=%.0f loops=%.0f removed=%.0f+%.0f\n", strings.Repeat("  ", depth),
		n.NodeType, n.Relation, n.IndexName, n.ActualRows, n.ActualLoops, n.RemovedByFilter, n.RemovedByJoinFilter)
	for _, c := range n.Plans {
		b.WriteString(c.text(depth + 1))
	}
	return b.String()
}

// explainAnalyzed runs stmt under EXPLAIN ANALYZE in a transaction it rolls back, and returns
// its plan and execution time.
func explainAnalyzed(t *testing.T, db store.DBTX, stmt string) (*planNode, float64) {
	t.Helper()
	ctx := context.Background()
	if _, err := db.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	defer db.Exec(ctx, "ROLLBACK")
	var out string
	if err := db.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+stmt).Scan(&out); err != nil {
		t.Fatal(err)
	}
	var plans []struct {
		Plan          *planNode `json:"Plan"`
		ExecutionTime float64   `json:"Execution Time"`
	}
	if err := json.Unmarshal([]byte(out), &plans); err != nil || len(plans) != 1 {
		t.Fatalf("EXPLAIN output %q: %v", out, err)
	}
	return plans[0].Plan, plans[0].ExecutionTime
}

// A renewal extends exactly the leases still held under their token, not revoked, on the
// database clock, and returns their tokens: not a stale token's, nor a revoked, finished or
// unknown job's; a job named twice, under an earlier claim's token and its current one, once.
// StillHeld finds the same leases, and the revoked one.
func TestRenewRenewsOnlyHeldLeases(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	held, revoked, finished := runningJob(t, db, time.Minute), runningJob(t, db, time.Minute), runningJob(t, db, time.Minute)
	again := runningJob(t, db, time.Minute)
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, again.ID); err != nil {
		t.Fatal(err)
	}
	if r, err := store.Rescue(ctx, db, 10); err != nil || len(r) != 1 {
		t.Fatalf("rescue: %v %v", r, err)
	}
	taken := claimOne(t, db, time.Minute)
	if taken.ID != again.ID {
		t.Fatalf("claimed job %d; want %d again", taken.ID, again.ID)
	}
	if ok, err := store.Revoke(ctx, db, revoked.ID, "stop"); err != nil || !ok {
		t.Fatalf("revoke: %v %v", ok, err)
	}
	if _, err := store.Finish(ctx, db, []store.Outcome{{ID: finished.ID, Token: finished.Token, State: store.StateCompleted}}); err != nil {
		t.Fatal(err)
	}
	var revokedUntil time.Time
	if err := db.QueryRow(ctx, `SELECT lease_expires_at FROM leash.jobs WHERE id = $1`, revoked.ID).Scan(&revokedUntil); err != nil {
		t.Fatal(err)
	}
	p := store.RenewParams{Lease: 90 * time.Second}
	for _, l := range []struct{ id, token int64 }{
		{taken.ID, taken.Token}, {held.ID, held.Token + 1000}, {revoked.ID, revoked.Token}, {held.ID, held.Token},
		{finished.ID, finished.Token}, {again.ID, again.Token}, {1 << 50, 1}, {held.ID, held.Token},
	} {
		p.IDs, p.Tokens = append(p.IDs, l.id), append(p.Tokens, l.token)
	}
	got, err := store.Renew(ctx, db, p)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]bool{held.Token: true, taken.Token: true}
	if len(got) != len(want) || !want[got[0]] || !want[got[1]] || got[0] == got[1] {
		t.Fatalf("renewed %v; want the tokens %d and %d once each", got, held.Token, taken.Token)
	}
	var leaseMS int64
	var beat bool
	if err := db.QueryRow(ctx, `SELECT (extract(epoch FROM lease_expires_at - heartbeat_at) * 1000)::bigint, heartbeat_at > now() - interval '1 minute'
		FROM leash.jobs WHERE id = $1`, held.ID).Scan(&leaseMS, &beat); err != nil {
		t.Fatal(err)
	}
	if leaseMS != p.Lease.Milliseconds() || !beat {
		t.Fatalf("renewed lease runs %d ms past its heartbeat (recent: %v); want %v", leaseMS, beat, p.Lease)
	}
	var until time.Time
	if err := db.QueryRow(ctx, `SELECT lease_expires_at FROM leash.jobs WHERE id = $1`, revoked.ID).Scan(&until); err != nil {
		t.Fatal(err)
	}
	if !until.Equal(revokedUntil) {
		t.Fatalf("the revoked job's lease moved from %v to %v", revokedUntil, until)
	}
	// StillHeld reads the same leases, revoked or not.
	stillHeld, err := store.StillHeld(ctx, db, p.IDs, p.Tokens)
	if err != nil {
		t.Fatal(err)
	}
	if len(stillHeld) != 3 || !stillHeld[held.ID] || !stillHeld[taken.ID] || !stillHeld[revoked.ID] {
		t.Fatalf("still held: %v; want jobs %d, %d and %d", stillHeld, held.ID, taken.ID, revoked.ID)
	}
}
