package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/pool"
)

// statsSampleInterval is how often each worker offers to sample the minute that has just ended
// for the admin page's charts. One worker at a time takes the turn and the others find the
// minute done, so the database does the work once a minute however many workers run; with one
// worker, a minute is sampled 5 to 15 s after it ends.
const statsSampleInterval = 10 * time.Second

// sampleStats samples minutes for the admin page's charts (pool.SampleMinuteStats) until ctx is
// done, then closes done.
func sampleStats(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, log *slog.Logger, every time.Duration, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if n, err := pool.SampleMinuteStats(ctx, db, pool.MinuteSampleParams{}); err != nil {
			if ctx.Err() == nil {
				log.WarnContext(ctx, "sample minute statistics for the admin page", slog.Any("err", err))
			}
		} else if n > 0 {
			log.DebugContext(ctx, "sampled minute statistics", slog.Int("minutes", n))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
