package pool_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/leashq/leash/pool"
)

// InvoiceArgs are the arguments of a job that sends an invoice.
type InvoiceArgs struct {
	Invoice int64 `json:"invoice"`
}

// Kind names the job kind of InvoiceArgs.
func (InvoiceArgs) Kind() string { return "invoice" }

// Example_unique inserts a unique job twice: the second insert inserts nothing, reports a
// duplicate, and returns the id of the job holding the key.
func Example_unique() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()

	// snippet:start unique
	opts := &pool.InsertOpts{UniqueKey: "invoice:42"} // one unfinished job per key
	first, err := pool.InsertArgs(ctx, db, InvoiceArgs{Invoice: 42}, opts)
	if err != nil {
		panic(err)
	}
	second, err := pool.InsertArgs(ctx, db, InvoiceArgs{Invoice: 42}, opts)
	if err != nil && !errors.Is(err, pool.ErrDuplicate) {
		panic(err)
	}
	var dup *pool.DuplicateError
	fmt.Println("duplicate:", errors.Is(err, pool.ErrDuplicate))
	fmt.Println("same job:", second == first, errors.As(err, &dup) && dup.ID == first)
	// snippet:end unique

	jobs, err := pool.ListJobs(ctx, db, pool.ListJobsParams{Kind: InvoiceArgs{}.Kind()})
	if err != nil {
		panic(err)
	}
	fmt.Println("jobs:", len(jobs))
	// Output:
	// duplicate: true
	// same job: true true
	// jobs: 1
}
