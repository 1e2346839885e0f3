package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// workflowChildren is the fan-out's width and workflowChain the chain's length.
const (
	workflowChildren = 10_000
	workflowChain    = 1_000
)

// workflows: a job that adds 10,000 children to its workflow and a join waiting for all of them,
// against a burn-down of as many independent jobs; a chain of 1,000 jobs each waiting for the
// previous one; and the burn-down with and without the workflow triggers (their cost to jobs
// outside workflows).
func (b *bench) workflows(ctx context.Context) {
	scenario := fmt.Sprintf("workflow fan-out %d + join, 100 workers", workflowChildren)
	logf("%s", scenario)
	var joinLatency []time.Duration
	b.trials(scenario, "jobs/s", "jobs/s", []trial{
		{system: "burn-down (independent jobs)", higherBetter: true, run: func() float64 {
			return b.leashBurn(ctx, workflowChildren+2, pool.Config{Concurrency: 100})
		}},
		{system: "leash workflow", higherBetter: true, baseline: []string{"burn-down (independent jobs)"}, run: func() float64 {
			jobsPerSec, join := b.fanOut(ctx)
			joinLatency = append(joinLatency, join)
			return jobsPerSec
		}},
	})
	b.addLatencies(scenario, "join start after last child", "", joinLatency, 50)

	scenario = fmt.Sprintf("workflow chain of %d", workflowChain)
	logf("%s", scenario)
	var links []time.Duration
	for range *flagRepeat {
		links = append(links, b.chain(ctx)...)
	}
	b.addLatencies(scenario, "per link", "", links, 50, 99)

	scenario = fmt.Sprintf("burn-down %d, 100 workers, workflow triggers", *flagJobs)
	logf("%s", scenario)
	b.trials(scenario, "jobs/s", "jobs/s", []trial{
		{system: "leash, triggers dropped", higherBetter: true, run: func() float64 {
			return b.leashBurnWith(ctx, *flagJobs, dropWorkflowTriggers)
		}},
		{system: "leash", higherBetter: true, baseline: []string{"leash, triggers dropped"}, run: func() float64 {
			return b.leashBurnWith(ctx, *flagJobs, "")
		}},
	})
}

// dropWorkflowTriggers removes the row triggers of 020 that fire on outcomes, for the baseline.
const dropWorkflowTriggers = `
	DROP TRIGGER jobs_workflow_finished ON leash.jobs;
	DROP TRIGGER jobs_workflow_retried ON leash.jobs;
	DROP TRIGGER jobs_workflow_deleted ON leash.jobs;
	DROP TRIGGER jobs_workflow_completing ON leash.jobs;
	DROP TRIGGER jobs_workflow_release ON leash.jobs;`

// leashBurnWith is leashBurn after running setup on the fresh database.
func (b *bench) leashBurnWith(ctx context.Context, n int, setup string) float64 {
	url := b.freshDB(ctx)
	db := open(ctx, url, 10)
	defer db.Close()
	if setup != "" {
		if _, err := db.Exec(ctx, setup); err != nil {
			fail(err)
		}
	}
	leashInsertNoops(ctx, db, n)
	cnt := newCounter(n)
	return float64(n) / leashDrain(ctx, newLeashConfig(db, pool.Config{Concurrency: 100, Observer: cnt}), cnt).Seconds()
}

// fanOut runs one workflow of a split job adding workflowChildren no-op children and a join
// waiting for them all; it returns the jobs/s of the whole workflow (split start to join end)
// and the time from the last child's completion to the join's start (database clock).
func (b *bench) fanOut(ctx context.Context) (float64, time.Duration) {
	url := b.freshDB(ctx)
	db := open(ctx, url, 10)
	defer db.Close()
	cnt := newCounter(workflowChildren + 2)
	p := newLeashConfig(db, pool.Config{Concurrency: 100, Observer: cnt})
	p.Register("split", pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		children := make([]pool.WorkflowJob, workflowChildren)
		steps := make([]string, workflowChildren)
		for i := range children {
			steps[i] = fmt.Sprintf("c%d", i)
			children[i] = pool.WorkflowJob{Step: steps[i], Kind: "noop"}
		}
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if _, err := j.AddToWorkflowTx(ctx, tx, children, map[string][]string{"join": steps}); err != nil {
				return err
			}
			return j.CompleteTx(ctx, tx)
		})
	}))
	if _, err := pool.InsertWorkflow(ctx, db, "fan-out", []pool.WorkflowJob{
		{Step: "split", Kind: "split"}, {Step: "join", Kind: "noop", DependsOn: []string{"split"}},
	}); err != nil {
		fail(err)
	}
	d := leashDrain(ctx, p, cnt)
	var join time.Duration
	if err := db.QueryRow(ctx, `
		SELECT j.attempted_at - (SELECT max(c.finished_at) FROM leash.jobs c WHERE c.workflow_id = j.workflow_id AND c.step LIKE 'c%')
		FROM leash.jobs j WHERE j.step = 'join'`).Scan(&join); err != nil {
		fail(err)
	}
	var children time.Duration
	if err := db.QueryRow(ctx, `
		SELECT max(c.finished_at) - min(c.attempted_at) FROM leash.jobs c
		WHERE c.workflow_id IS NOT NULL AND c.step LIKE 'c%'`).Scan(&children); err != nil {
		fail(err)
	}
	logf("    children ran for %s, the join started %s after the last, %s in all", children, join, d)
	b.dropDB(ctx, url)
	return float64(workflowChildren+2) / d.Seconds(), join
}

// chain runs one workflow of workflowChain no-op jobs, each waiting for the previous one, and
// returns each link's latency: from a job's completion to the next one's start (database clock).
func (b *bench) chain(ctx context.Context) []time.Duration {
	url := b.freshDB(ctx)
	db := open(ctx, url, 10)
	defer db.Close()
	jobs := make([]pool.WorkflowJob, workflowChain)
	for i := range jobs {
		jobs[i] = pool.WorkflowJob{Step: fmt.Sprintf("s%d", i), Kind: "noop"}
		if i > 0 {
			jobs[i].DependsOn = []string{fmt.Sprintf("s%d", i-1)}
		}
	}
	if _, err := pool.InsertWorkflow(ctx, db, "chain", jobs); err != nil {
		fail(err)
	}
	cnt := newCounter(workflowChain)
	leashDrain(ctx, newLeashConfig(db, pool.Config{Concurrency: 10, Observer: cnt}), cnt)
	links := linkLatencies(ctx, db)
	b.dropDB(ctx, url)
	return links
}

func linkLatencies(ctx context.Context, db *pgxpool.Pool) []time.Duration {
	rows, err := db.Query(ctx, `
		SELECT n.attempted_at - p.finished_at FROM leash.jobs n
		JOIN leash.jobs p ON p.workflow_id = n.workflow_id AND p.step = n.depends_on[1]
		WHERE n.depends_on IS NOT NULL`)
	if err != nil {
		fail(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[time.Duration])
	if err != nil {
		fail(err)
	}
	return out
}
