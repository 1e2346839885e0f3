package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// A workflow runs its jobs in dependency order on a pool, and each job reads the outputs of its
// dependencies by step.
func TestWorkflowRunsInOrderWithOutputs(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var order []string
	inputs := map[string]map[string]json.RawMessage{}
	step := func(ctx context.Context, j *pool.Job) error {
		var p struct{ Step string }
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return err
		}
		outs, err := j.DependencyOutputs(ctx)
		if err != nil {
			return err
		}
		mu.Lock()
		order = append(order, p.Step)
		inputs[p.Step] = outs
		mu.Unlock()
		return j.SetOutput(map[string]string{"from": p.Step})
	}
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"step": pool.HandlerFunc(step)})
	ctx := context.Background()
	job := func(s string, deps ...string) pool.WorkflowJob {
		return pool.WorkflowJob{Step: s, DependsOn: deps, Kind: "step", Payload: map[string]string{"step": s}}
	}
	wf, err := pool.InsertWorkflow(ctx, b.db, "etl", []pool.WorkflowJob{
		job("load", "transform-a", "transform-b"), job("transform-a", "extract"), job("transform-b", "extract"), job("extract"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(wf.JobIDs) != 4 || wf.ID == 0 {
		t.Fatalf("inserted %+v", wf)
	}
	if st := getRow(t, b.db, wf.JobIDs[0]).State; st != "pending" {
		t.Fatalf("load is %s before its dependencies ran", st)
	}
	start(t, p)
	b.events.wait(t, 4, 20*time.Second)
	mu.Lock()
	defer mu.Unlock()
	pos := map[string]int{}
	for i, s := range order {
		pos[s] = i
	}
	if pos["extract"] != 0 || pos["load"] != 3 {
		t.Fatalf("ran in order %v", order)
	}
	if got := inputs["load"]; len(got) != 2 || !strings.Contains(string(got["transform-a"]), `"transform-a"`) {
		t.Fatalf("load read %v", got)
	}
	if len(inputs["extract"]) != 0 {
		t.Fatalf("extract read %v", inputs["extract"])
	}
	info, err := pool.GetWorkflow(ctx, b.db, wf.ID, 100)
	if err != nil || len(info.Steps) != 4 || info.Name != "etl" {
		t.Fatalf("GetWorkflow: %+v %v", info, err)
	}
	for _, s := range info.Steps {
		if s.State != pool.StateCompleted {
			t.Errorf("step %s is %s", s.Step, s.State)
		}
	}
}

// Bad graphs are refused before anything is inserted.
func TestInsertWorkflowRefusesBadGraphs(t *testing.T) {
	t.Parallel()
	_, b := setup(t, nil, fastConfig(), nil)
	ctx := context.Background()
	for name, jobs := range map[string][]pool.WorkflowJob{
		"cycle":     {{Step: "a", DependsOn: []string{"b"}, Kind: "k"}, {Step: "b", DependsOn: []string{"a"}, Kind: "k"}},
		"unknown":   {{Step: "a", DependsOn: []string{"x"}, Kind: "k"}},
		"duplicate": {{Step: "a", Kind: "k"}, {Step: "a", Kind: "k"}},
		"nul":       {{Step: "a\x00b", Kind: "k"}},
		"huge":      {{Step: strings.Repeat("s", 2000), Kind: "k"}},
		"unique":    {{Step: "a", Kind: "k", Opts: &pool.InsertOpts{UniqueKey: "u"}}},
	} {
		if _, err := pool.InsertWorkflow(ctx, b.db, name, jobs); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("%s: %v, want ErrInvalidJob", name, err)
		}
	}
	if _, err := pool.InsertWorkflow(ctx, b.db, "x\x00", nil); !errors.Is(err, pool.ErrInvalidJob) {
		t.Errorf("NUL name: %v", err)
	}
	var n int
	if err := b.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d jobs inserted (%v)", n, err)
	}
}

// A running job fans out: it adds children to its own workflow and makes the join, which has not
// started, wait for them too; the join runs once all the children completed.
func TestWorkflowFanOut(t *testing.T) {
	t.Parallel()
	const children = 50
	var mu sync.Mutex
	var joinSaw int
	var db *pgxpool.Pool
	handlers := map[string]pool.Handler{
		"split": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			var jobs []pool.WorkflowJob
			var steps []string
			for i := range children {
				s := fmt.Sprintf("part-%d", i)
				steps = append(steps, s)
				jobs = append(jobs, pool.WorkflowJob{Step: s, Kind: "part", Payload: map[string]int{"n": i}})
			}
			return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				if _, err := j.AddToWorkflowTx(ctx, tx, jobs, map[string][]string{"join": steps}); err != nil {
					return err
				}
				return j.CompleteTx(ctx, tx)
			})
		}),
		"part": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			return j.SetOutput(1)
		}),
		"join": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			outs, err := j.DependencyOutputs(ctx)
			mu.Lock()
			joinSaw = len(outs)
			mu.Unlock()
			return err
		}),
	}
	p, b := setup(t, nil, fastConfig(), handlers)
	db = b.db
	ctx := context.Background()
	wf, err := pool.InsertWorkflow(ctx, b.db, "fan", []pool.WorkflowJob{
		{Step: "split", Kind: "split"}, {Step: "join", Kind: "join", DependsOn: []string{"split"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	start(t, p)
	evs := b.events.wait(t, children+2, 30*time.Second)
	if last := evs[len(evs)-1]; last.Kind != "join" {
		t.Fatalf("the last job to finish is %s, not the join", last.Kind)
	}
	mu.Lock()
	defer mu.Unlock()
	if joinSaw != children+1 {
		t.Fatalf("the join read %d dependency outputs, want %d", joinSaw, children+1)
	}
	if st := getRow(t, b.db, wf.JobIDs[1]).State; st != "completed" {
		t.Fatalf("join %s", st)
	}
}

// A job whose lease is gone adds nothing to its workflow: the fence fails the statement or the
// commit.
func TestWorkflowFanOutFenced(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"split": h})
	ctx := context.Background()
	if _, err := pool.InsertWorkflow(ctx, b.db, "fan", []pool.WorkflowJob{{Step: "split", Kind: "split"}}); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	j := h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	tx, err := b.db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := j.AddToWorkflowTx(ctx, tx, []pool.WorkflowJob{{Step: "child", Kind: "k"}}, nil); err != nil {
		t.Fatal(err)
	}
	mustExec(t, b.db, "SELECT leash.revoke_job($1, 'stop')", j.ID)
	if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
		t.Fatalf("cause %v", c.cause)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("a revoked job's fan-out committed")
	}
	var n int
	if err := b.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE step = 'child'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d children committed (%v)", n, err)
	}
	// After the revocation, the fence itself refuses.
	if _, err := j.AddToWorkflowTx(ctx, mustBegin(t, b), []pool.WorkflowJob{{Step: "child", Kind: "k"}}, nil); !errors.Is(err, pool.ErrFenced) {
		t.Fatalf("AddToWorkflowTx after revocation: %v", err)
	}
}

func mustBegin(t *testing.T, b *bundle) pgx.Tx {
	t.Helper()
	tx, err := b.db.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	return tx
}

// RevokeWorkflow stops the running jobs through the same path as RevokeJob (lease.ErrRevoked)
// and cancels the rest; the pool never starts them.
func TestRevokeWorkflowStopsRunningAndCancelsRest(t *testing.T) {
	t.Parallel()
	h := newBlocker()
	p, b := setup(t, nil, slowHeartbeat(), map[string]pool.Handler{"block": h})
	ctx := context.Background()
	wf, err := pool.InsertWorkflow(ctx, b.db, "w", []pool.WorkflowJob{
		{Step: "a", Kind: "block"}, {Step: "b", Kind: "block"}, {Step: "c", Kind: "block", DependsOn: []string{"a", "b"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	start(t, p)
	h.next(t)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	n, err := pool.RevokeWorkflow(ctx, b.db, wf.ID, "abandon")
	if err != nil || n != 3 {
		t.Fatalf("RevokeWorkflow: %d, %v", n, err)
	}
	for range 2 {
		if c := h.cause(t); !errors.Is(c.cause, lease.ErrRevoked) {
			t.Fatalf("cause %v", c.cause)
		}
	}
	b.events.wait(t, 2, 10*time.Second)
	for _, id := range wf.JobIDs {
		if r := getRow(t, b.db, id); r.State != "cancelled" || !r.Revoked {
			t.Errorf("job %d: %+v", id, r)
		}
	}
}

// The pool that writes the outcome completing a job's last dependency claims that job at once,
// whether or not a notification reaches it: here the pool waits for wake-ups (registered, so a
// freed slot does not make it claim), the notification of the release is lost (the waiting hint
// says no one waits), and the poll is a minute away; yet the second job of a chain starts as
// soon as the first one's outcome is written.
func TestWorkflowReleasedJobClaimedWithoutAPoll(t *testing.T) {
	t.Parallel()
	started := make(chan string, 2)
	finishA := make(chan struct{})
	step := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		var p struct{ Step string }
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return err
		}
		started <- p.Step
		if p.Step == "a" {
			<-finishA
		}
		return nil
	})
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"step": step})
	ctx := context.Background()
	if _, err := pool.InsertWorkflow(ctx, b.db, "chain", []pool.WorkflowJob{
		{Step: "a", Kind: "step", Payload: map[string]string{"step": "a"}},
		{Step: "b", Kind: "step", Payload: map[string]string{"step": "b"}, DependsOn: []string{"a"}},
	}); err != nil {
		t.Fatal(err)
	}
	start(t, p)
	if got := <-started; got != "a" {
		t.Fatalf("started %s first", got)
	}
	// Wait for the pool to register as waiting, then lose every notification: the hint the
	// release reads says nobody waits.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := b.db.QueryRow(ctx, `SELECT count(*) FROM leash.waiters WHERE expires_at > now() AND woken_at IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pool never registered as waiting")
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // past the registration's re-checks (at most 63 ms)
	if _, err := b.db.Exec(ctx, `SELECT setval('leash.waiting_until', 0)`); err != nil {
		t.Fatal(err)
	}
	close(finishA)
	select {
	case got := <-started:
		if got != "b" {
			t.Fatalf("started %s, want b", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("b not started within 10s of a's end (the poll is a minute away)")
	}
}

// A job of a workflow keeps its concurrency key: the queue's per-key limit holds for it as for
// any job.
func TestWorkflowJobKeepsConcurrencyKey(t *testing.T) {
	t.Parallel()
	_, b := setup(t, nil, fastConfig(), nil)
	ctx := context.Background()
	opts := &pool.InsertOpts{ConcurrencyKey: "tenant-7"}
	wf, err := pool.InsertWorkflow(ctx, b.db, "keyed", []pool.WorkflowJob{
		{Step: "a", Kind: "step", Opts: opts}, {Step: "b", DependsOn: []string{"a"}, Kind: "step", Opts: opts},
	})
	if err != nil {
		t.Fatal(err)
	}
	// A large workflow is copied in rather than inserted by a statement: the same holds.
	wide := make([]pool.WorkflowJob, 300)
	for i := range wide {
		wide[i] = pool.WorkflowJob{Step: fmt.Sprintf("w%d", i), Kind: "step", Opts: opts}
	}
	wideWf, err := pool.InsertWorkflow(ctx, b.db, "keyed-wide", wide)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range append(wf.JobIDs, wideWf.JobIDs...) {
		var key *string
		if err := b.db.QueryRow(ctx, `SELECT concurrency_key FROM leash.jobs WHERE id = $1`, id).Scan(&key); err != nil {
			t.Fatal(err)
		}
		if key == nil || *key != "tenant-7" {
			t.Fatalf("job %d of the workflow has key %v", id, key)
		}
	}
}
