package pool

import (
	"context"
	"fmt"
)

// JobArgs is a job's arguments: a type that marshals to JSON and names its kind, so that the
// handler registered for it (AddWorker) and every insert of it (InsertArgs) agree on the kind by
// construction, and a typo cannot make a job no worker runs. Kind must not depend on the value:
// it is called on the zero value to register the handler, so give it a value receiver.
//
//	type EmailArgs struct {
//		To string `json:"to"`
//	}
//
//	func (EmailArgs) Kind() string { return "email" }
//
// String kinds (Register, Insert) remain for jobs inserted from SQL and for the worker binary.
type JobArgs interface {
	Kind() string
}

// AddWorker registers fn as the handler of A's kind on p. Each job's payload is decoded strictly
// into an A (unknown fields are errors, as with Args); a payload that does not decode fails the
// job permanently with an error naming the kind and the field. It fails like Register when the
// kind is empty or already registered.
func AddWorker[A JobArgs](p *Pool, fn func(ctx context.Context, job *Job, args A) error) error {
	if fn == nil {
		return fmt.Errorf("pool: AddWorker[%T] needs a function", *new(A))
	}
	return p.Register(kindOf[A](), Args(fn))
}

// kindOf is the kind A names, read from its zero value.
func kindOf[A JobArgs]() string {
	var a A
	return a.Kind()
}

// InsertArgs enqueues one job of args' kind with args as its payload, like Insert, and returns
// its id.
func InsertArgs(ctx context.Context, db DB, args JobArgs, opts *InsertOpts) (int64, error) {
	if args == nil {
		return 0, fmt.Errorf("%w: InsertArgs with nil args", ErrInvalidJob)
	}
	return Insert(ctx, db, args.Kind(), args, opts)
}
