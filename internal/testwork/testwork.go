// Package testwork carries package pool's function that runs one attempt of a job outside a
// Pool to package pool/pooltest, which cannot reach pool's internals itself. Package pool sets
// Work when it is initialised; pooltest asserts it to its one type.
package testwork

// Work is pool's func(ctx context.Context, db pool.DB, kind string, payload any,
// opts *pool.InsertOpts, h pool.Handler) (job *pool.Job, state string, handlerErr, err error),
// set by package pool.
var Work any
