package leashotel

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/pool"
)

// WithTrace returns a copy of opts (nil: the defaults) whose TraceContext carries ctx's span,
// so that the job's attempts are traced as its children (see Config.LinkAfter). The copy is
// unchanged when opts already has a TraceContext or ctx carries no valid span.
func WithTrace(ctx context.Context, opts *pool.InsertOpts) *pool.InsertOpts {
	var o pool.InsertOpts
	if opts != nil {
		o = *opts
	}
	if o.TraceContext == nil {
		o.TraceContext = Carrier(ctx)
	}
	return &o
}

// Insert is pool.Insert with ctx's trace context stored with the job.
func Insert(ctx context.Context, db pool.DB, kind string, payload any, opts *pool.InsertOpts) (int64, error) {
	return pool.Insert(ctx, db, kind, payload, WithTrace(ctx, opts))
}

// InsertTx is pool.InsertTx with ctx's trace context stored with the job.
func InsertTx(ctx context.Context, tx pgx.Tx, kind string, payload any, opts *pool.InsertOpts) (int64, error) {
	return pool.InsertTx(ctx, tx, kind, payload, WithTrace(ctx, opts))
}

// InsertMany is pool.InsertMany with ctx's trace context stored with every job that has none of
// its own.
func InsertMany(ctx context.Context, db pool.CopyDB, jobs []pool.InsertManyParams) (int64, error) {
	tc := Carrier(ctx)
	if tc == nil {
		return pool.InsertMany(ctx, db, jobs)
	}
	traced := make([]pool.InsertManyParams, len(jobs))
	for i, j := range jobs {
		if j.Opts == nil || j.Opts.TraceContext == nil {
			var o pool.InsertOpts
			if j.Opts != nil {
				o = *j.Opts
			}
			o.TraceContext = tc // shared: pool only reads it
			j.Opts = &o
		}
		traced[i] = j
	}
	return pool.InsertMany(ctx, db, traced)
}
