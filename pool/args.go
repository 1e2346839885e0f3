package pool

import (
	"context"
	"fmt"
	"reflect"

	"github.com/jackc/pgx/v5"
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

// AddWorker registers fn as the handler of A's kind on p. Each job's payload is decoded into an
// A as Args does (unknown fields ignored; a payload that does not decode fails the job
// permanently with an error naming the kind and the field). A may be a pointer type (*T): fn
// then gets a pointer to a fresh T, also for a payload of JSON null. It fails like Register when
// the kind is empty or already registered, or once Run has started.
func AddWorker[A JobArgs](p *Pool, fn func(ctx context.Context, job *Job, args A) error) error {
	if fn == nil {
		return fmt.Errorf("pool: AddWorker[%T] needs a function", *new(A))
	}
	kind, err := KindOf[A]()
	if err != nil {
		return err
	}
	return p.Register(kind, Args(fn))
}

// KindOf returns the kind A names (A's Kind on its zero value, or on a pointer to a fresh value
// when A is a pointer type), or an error when Kind panics or names no kind. pooltest uses it, so
// that a test and a pool agree on the kind.
func KindOf[A JobArgs]() (kind string, err error) {
	var a A
	if t := reflect.TypeFor[A](); t.Kind() == reflect.Pointer {
		a = reflect.New(t.Elem()).Interface().(A)
	}
	defer func() {
		if r := recover(); r != nil {
			kind, err = "", fmt.Errorf("pool: %T.Kind() panicked on a zero value (%v): Kind must not depend on the value", a, r)
		}
	}()
	if kind = a.Kind(); kind == "" {
		return "", fmt.Errorf("pool: %T.Kind() names no kind", a)
	}
	return kind, nil
}

// InsertArgs enqueues one job of args' kind with args as its payload, like Insert, and returns
// its id.
func InsertArgs(ctx context.Context, db DB, args JobArgs, opts *InsertOpts) (int64, error) {
	kind, err := argsKind(args)
	if err != nil {
		return 0, err
	}
	return Insert(ctx, db, kind, args, opts)
}

// InsertArgsTx enqueues one job of args' kind inside the caller's transaction, like InsertTx: it
// becomes visible, and wakes workers, only when tx commits.
func InsertArgsTx(ctx context.Context, tx pgx.Tx, args JobArgs, opts *InsertOpts) (int64, error) {
	return InsertArgs(ctx, tx, args, opts)
}

// argsKind is args' kind, or an ErrInvalidJob when args is nil (or a nil pointer whose Kind
// panics) or names no kind.
func argsKind(args JobArgs) (kind string, err error) {
	if args == nil {
		return "", fmt.Errorf("%w: nil args", ErrInvalidJob)
	}
	defer func() {
		if r := recover(); r != nil {
			kind, err = "", fmt.Errorf("%w: %T.Kind() panicked (%v)", ErrInvalidJob, args, r)
		}
	}()
	if kind = args.Kind(); kind == "" {
		return "", fmt.Errorf("%w: %T.Kind() names no kind", ErrInvalidJob, args)
	}
	return kind, nil
}
