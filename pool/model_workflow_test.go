package pool_test

// A model-based randomized test of workflows: random DAGs run by two pools on one database while
// the driver retries failed jobs, revokes jobs and whole workflows, takes leases away (forced
// expiry, rescued by the other pool) and restarts pools. Handlers fail, for now or for good, at
// random. Checked: no job starts before each of its dependencies completed (or finished, when it
// may fail), read in the database as it starts; once nothing runs, no pending job has all its
// dependencies done (none waits forever), every job cancelled by a dependency names one that
// failed or was cancelled, and every job of a revoked workflow is finished.
//
//	LEASH_MODEL_SEED=<n>  run only that seed

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

func TestModelWorkflows(t *testing.T) {
	t.Parallel()
	seeds := []int64{1, 2, 3}
	if s := os.Getenv("LEASH_MODEL_SEED"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		seeds = []int64{n}
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			runWorkflowModel(t, seed, 3*time.Second)
		})
	}
}

// wfScript is what a job's handler does, attempt by attempt: "ok", "retry" (an error),
// "perm" (a permanent failure); past the script's end it succeeds. Hold is how long it runs.
type wfScript struct {
	Steps []string `json:"steps"`
	Hold  int      `json:"hold_ms"`
}

type wfModel struct {
	t    *testing.T
	seed int64
	rng  *rand.Rand
	db   *pgxpool.Pool

	mu         sync.Mutex
	violations []string
	pools      []*pool.Pool
	stops      []chan error
	workflows  []int64
	revoked    map[int64]bool
}

func (m *wfModel) violate(format string, args ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.violations = append(m.violations, fmt.Sprintf(format, args...))
}

// handle checks, as the attempt starts, that every dependency of the job is done, then plays
// its script.
func (m *wfModel) handle(ctx context.Context, j *pool.Job) error {
	var notDone []string
	err := m.db.QueryRow(ctx, `
		SELECT coalesce(array_agg(d.step || ':' || coalesce(d.state, 'missing')), '{}')
		FROM leash.jobs j CROSS JOIN LATERAL unnest(j.depends_on) s(step)
		LEFT JOIN leash.jobs d ON d.workflow_id = j.workflow_id AND d.step = s.step
		WHERE j.id = $1 AND NOT coalesce(d.state = 'completed' OR (d.may_fail AND d.state IN ('failed', 'cancelled')), false)`,
		j.ID).Scan(&notDone)
	if err != nil && ctx.Err() == nil {
		m.violate("job %d: reading its dependencies: %v", j.ID, err)
	}
	if len(notDone) > 0 {
		m.violate("job %d started (attempt %d) before its dependencies were done: %v", j.ID, j.Attempt, notDone)
	}
	var s wfScript
	if err := json.Unmarshal(j.Payload, &s); err != nil {
		return pool.Permanent(err)
	}
	if err := pool.Sleep(ctx, time.Duration(s.Hold)*time.Millisecond); err != nil {
		return err
	}
	act := "ok"
	if j.Attempt-1 < len(s.Steps) {
		act = s.Steps[j.Attempt-1]
	}
	switch act {
	case "retry":
		return fmt.Errorf("scripted failure")
	case "perm":
		return pool.Permanent(fmt.Errorf("scripted permanent failure"))
	}
	return j.SetOutput(map[string]int64{"job": j.ID})
}

func (m *wfModel) startPool() {
	p, err := pool.New(m.db, pool.Config{Concurrency: 4, LeaseDuration: time.Second, HeartbeatInterval: 200 * time.Millisecond,
		PollInterval: 100 * time.Millisecond, RescueInterval: 150 * time.Millisecond, ShutdownTimeout: 300 * time.Millisecond,
		RetryBackoff: func(int) time.Duration { return 20 * time.Millisecond }})
	if err != nil {
		m.t.Fatal(err)
	}
	if err := p.Register("wf", pool.HandlerFunc(m.handle)); err != nil {
		m.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	m.mu.Lock()
	m.pools, m.stops = append(m.pools, p), append(m.stops, done)
	m.mu.Unlock()
}

func (m *wfModel) stopPool(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m.pools[i].Shutdown(ctx)
	if err := <-m.stops[i]; err != nil {
		m.t.Errorf("seed %d: Run: %v", m.seed, err)
	}
	m.pools = append(m.pools[:i], m.pools[i+1:]...)
	m.stops = append(m.stops[:i], m.stops[i+1:]...)
}

// randomWorkflow inserts a DAG of 2 to 12 jobs, each depending on up to three earlier ones.
func (m *wfModel) randomWorkflow(ctx context.Context) {
	n := 2 + m.rng.IntN(11)
	jobs := make([]pool.WorkflowJob, n)
	for i := range jobs {
		s := wfScript{Hold: m.rng.IntN(60)}
		for range m.rng.IntN(3) {
			s.Steps = append(s.Steps, []string{"ok", "retry", "retry", "perm"}[m.rng.IntN(4)])
		}
		jobs[i] = pool.WorkflowJob{Step: fmt.Sprintf("s%d", i), Kind: "wf", Payload: s, MayFail: m.rng.IntN(5) == 0,
			Opts: &pool.InsertOpts{MaxAttempts: 3}}
		for range m.rng.IntN(4) {
			if i > 0 {
				d := fmt.Sprintf("s%d", m.rng.IntN(i))
				if !slicesContains(jobs[i].DependsOn, d) {
					jobs[i].DependsOn = append(jobs[i].DependsOn, d)
				}
			}
		}
	}
	// Listed in a random order: the database does not need dependencies first.
	m.rng.Shuffle(n, func(a, b int) { jobs[a], jobs[b] = jobs[b], jobs[a] })
	wf, err := pool.InsertWorkflow(ctx, m.db, "model", jobs)
	if err != nil {
		m.t.Fatalf("seed %d: insert workflow: %v", m.seed, err)
	}
	m.workflows = append(m.workflows, wf.ID)
}

func slicesContains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// pickJob returns a random job of a workflow not revoked, in one of the states given.
func (m *wfModel) pickJob(ctx context.Context, states ...string) (int64, bool) {
	var id int64
	err := m.db.QueryRow(ctx, `SELECT id FROM leash.jobs WHERE workflow_id IS NOT NULL AND state = ANY ($1)
		AND NOT workflow_id = ANY ($2) ORDER BY id OFFSET $3 LIMIT 1`, states, m.revokedIDs(), m.rng.IntN(5)).Scan(&id)
	return id, err == nil
}

func (m *wfModel) revokedIDs() []int64 {
	var out []int64
	for id := range m.revoked {
		out = append(out, id)
	}
	return out
}

func (m *wfModel) step(ctx context.Context) {
	switch r := m.rng.IntN(20); {
	case r < 6:
		m.randomWorkflow(ctx)
	case r < 9:
		if id, ok := m.pickJob(ctx, "failed", "cancelled"); ok {
			// Refused while a dependency of it failed: that is fine here.
			pool.RetryJob(ctx, m.db, id)
		}
	case r < 11:
		if id, ok := m.pickJob(ctx, "pending", "available", "running"); ok {
			pool.RevokeJob(ctx, m.db, id, "model")
		}
	case r < 12:
		if len(m.workflows) > 0 {
			w := m.workflows[m.rng.IntN(len(m.workflows))]
			if _, err := pool.RevokeWorkflow(ctx, m.db, w, "model"); err != nil {
				m.t.Fatalf("seed %d: revoke workflow: %v", m.seed, err)
			}
			m.revoked[w] = true
		}
	case r < 15:
		// A lease taken away: the other pool's rescuer takes the job over.
		m.db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'
			WHERE id = (SELECT id FROM leash.jobs WHERE state = 'running' ORDER BY random() LIMIT 1)`)
	case r < 16:
		if len(m.pools) > 1 {
			m.stopPool(m.rng.IntN(len(m.pools)))
			m.startPool()
		}
	}
}

func runWorkflowModel(t *testing.T, seed int64, chaos time.Duration) {
	m := &wfModel{t: t, seed: seed, rng: rand.New(rand.NewPCG(uint64(seed), 18)), db: pgtest.Pool(t), revoked: map[int64]bool{}}
	ctx := context.Background()
	m.startPool()
	m.startPool()
	defer func() {
		for len(m.pools) > 0 {
			m.stopPool(0)
		}
	}()
	for end := time.Now().Add(chaos); time.Now().Before(end); {
		m.step(ctx)
		time.Sleep(time.Duration(m.rng.IntN(40)) * time.Millisecond)
	}
	// Settle: nothing queued or running is left once the pools drained what they could.
	deadline := time.Now().Add(60 * time.Second)
	for {
		var open int
		if err := m.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state IN ('available', 'retryable', 'running')`).Scan(&open); err != nil {
			t.Fatal(err)
		}
		if open == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("seed %d: %d jobs still queued or running after 60s", seed, open)
		}
		time.Sleep(50 * time.Millisecond)
	}
	m.check(ctx)
}

func (m *wfModel) check(ctx context.Context) {
	t := m.t
	// None waits forever: a pending job has a dependency not done.
	var stuck []int64
	rows, err := m.db.Query(ctx, `
		SELECT j.id FROM leash.jobs j WHERE j.state = 'pending' AND NOT EXISTS (
			SELECT FROM unnest(j.depends_on) s(step)
			LEFT JOIN leash.jobs d ON d.workflow_id = j.workflow_id AND d.step = s.step
			WHERE NOT coalesce(d.state = 'completed' OR (d.may_fail AND d.state IN ('failed', 'cancelled')), false))`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		stuck = append(stuck, id)
	}
	rows.Close()
	if len(stuck) > 0 {
		m.violate("pending jobs whose dependencies are all done: %v", stuck)
	}
	// A pending job waits for a dependency that is itself unfinished or blocked, never for one
	// that failed for good: that one should have cancelled it.
	var orphans []int64
	rows, err = m.db.Query(ctx, `
		SELECT j.id FROM leash.jobs j WHERE j.state = 'pending' AND EXISTS (
			SELECT FROM unnest(j.depends_on) s(step)
			JOIN leash.jobs d ON d.workflow_id = j.workflow_id AND d.step = s.step
			WHERE d.state IN ('failed', 'cancelled') AND NOT coalesce(d.may_fail, false))`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		orphans = append(orphans, id)
	}
	rows.Close()
	if len(orphans) > 0 {
		m.violate("pending jobs waiting for a dependency that failed or was cancelled: %v", orphans)
	}
	// Every job cancelled by a dependency names one that is failed or cancelled now.
	var causeless []int64
	rows, err = m.db.Query(ctx, `
		SELECT j.id FROM leash.jobs j WHERE j.state = 'cancelled' AND j.unmet > 0 AND j.revoked_at IS NULL
		  AND j.last_error LIKE 'dependency %' AND NOT EXISTS (
			SELECT FROM unnest(j.depends_on) s(step)
			JOIN leash.jobs d ON d.workflow_id = j.workflow_id AND d.step = s.step
			WHERE d.state IN ('failed', 'cancelled', 'pending'))`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		causeless = append(causeless, id)
	}
	rows.Close()
	if len(causeless) > 0 {
		m.violate("jobs cancelled by a dependency none of which failed: %v", causeless)
	}
	// Every job of a revoked workflow is finished.
	for w := range m.revoked {
		var open int
		if err := m.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE workflow_id = $1
			AND state NOT IN ('completed', 'failed', 'cancelled')`, w).Scan(&open); err != nil {
			t.Fatal(err)
		}
		if open > 0 {
			m.violate("workflow %d: revoked, %d jobs unfinished", w, open)
		}
	}
	var total, completed int
	m.db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'completed') FROM leash.jobs`).Scan(&total, &completed)
	t.Logf("seed %d: %d workflows (%d revoked), %d jobs, %d completed", m.seed, len(m.workflows), len(m.revoked), total, completed)
	if completed == 0 {
		m.violate("no job completed")
	}
	for _, v := range m.violations {
		t.Errorf("seed %d: %s", m.seed, v)
	}
}
