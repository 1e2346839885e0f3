package pool_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/pool"
)

// Example_workflow inserts a workflow of four jobs: extract, two transforms that wait for it, and
// a load that waits for both. Until its dependencies completed, a job is pending.
func Example_workflow() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()

	// snippet:start workflow
	wf, err := pool.InsertWorkflow(ctx, db, "nightly-etl", []pool.WorkflowJob{
		{Step: "extract", Kind: "extract"},
		{Step: "transform-a", Kind: "transform", DependsOn: []string{"extract"}},
		// MayFail: load runs even if this one fails for good.
		{Step: "transform-b", Kind: "transform", DependsOn: []string{"extract"}, MayFail: true},
		{Step: "load", Kind: "load", DependsOn: []string{"transform-a", "transform-b"}},
	})
	if err != nil {
		panic(err)
	}
	// snippet:end workflow

	info, err := pool.GetWorkflow(ctx, db, wf.ID, 100)
	if err != nil {
		panic(err)
	}
	for _, s := range info.Steps {
		fmt.Println(s.Step, s.State)
	}
	// Output:
	// extract available
	// transform-a pending
	// transform-b pending
	// load pending
}

// fanOut is a handler that splits its work into parts, added to its own workflow in the
// transaction that completes it, and makes the join wait for them.
func fanOut(db *pgx.Conn) pool.HandlerFunc {
	// snippet:start fanout
	return func(ctx context.Context, j *pool.Job) error {
		parts := []pool.WorkflowJob{{Step: "part-1", Kind: "part"}, {Step: "part-2", Kind: "part"}}
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			// Fenced by this claim: a job that lost its lease adds nothing.
			if _, err := j.AddToWorkflowTx(ctx, tx, parts, map[string][]string{"join": {"part-1", "part-2"}}); err != nil {
				return err
			}
			return j.CompleteTx(ctx, tx)
		})
	}
	// snippet:end fanout
}

// join reads what its dependencies recorded.
func join(ctx context.Context, j *pool.Job) error {
	// snippet:start dependency-outputs
	outs, err := j.DependencyOutputs(ctx) // step -> output (SetOutput), in one query
	if err != nil {
		return err
	}
	for step, out := range outs {
		fmt.Printf("%s recorded %s\n", step, out)
	}
	// snippet:end dependency-outputs
	return nil
}

var _, _ = fanOut, join
