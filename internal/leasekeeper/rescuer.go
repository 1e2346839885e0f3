package leasekeeper

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/leashq/leash/internal/store"
)

// RescueBatchDefault is how many expired leases one rescue statement takes back at most.
const RescueBatchDefault = 1000

// Rescuer takes back running jobs whose lease expired on the database clock. Every worker runs
// one; rows another rescuer is on are skipped, so running many at once is safe.
type Rescuer struct {
	// DB runs the rescue statement. Required.
	DB DB
	// Interval between passes, jittered by up to a fifth. Required.
	Interval time.Duration
	// Batch is the most rows one pass takes back. Default RescueBatchDefault.
	Batch int
	// Logger receives one line per rescued job. Default: discard.
	Logger *slog.Logger
	// Metrics, when set, counts rescued jobs.
	Metrics *Metrics
}

// Rescued is a running job whose lease expired and that a rescuer took back.
type Rescued = store.Rescued

// RunOnce takes back every expired lease it finds (in batches) and returns what it did.
func (r *Rescuer) RunOnce(ctx context.Context) ([]Rescued, error) {
	batch := r.Batch
	if batch <= 0 {
		batch = RescueBatchDefault
	}
	log := r.logger()
	var all []Rescued
	for {
		got, err := store.Rescue(ctx, r.DB, batch)
		if err != nil {
			return all, err
		}
		all = append(all, got...)
		for _, j := range got {
			log.WarnContext(ctx, "took back job with expired lease",
				slog.Int64("job_id", j.ID), slog.Int64("old_lease_token", j.OldToken),
				slog.String("old_holder", j.OldOwner), slog.String("state", j.State))
		}
		if r.Metrics != nil {
			r.Metrics.Rescued.Add(int64(len(got)))
		}
		if len(got) < batch {
			return all, nil
		}
	}
}

func (r *Rescuer) logger() *slog.Logger {
	if r.Logger == nil {
		return discard
	}
	return r.Logger
}

// Run calls RunOnce every Interval until ctx is done.
func (r *Rescuer) Run(ctx context.Context) {
	log := r.logger()
	for {
		d := r.Interval + time.Duration(rand.Int64N(int64(r.Interval)/5+1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
		sctx, cancel := context.WithTimeout(ctx, r.Interval+5*time.Second)
		if _, err := r.RunOnce(sctx); err != nil && ctx.Err() == nil {
			log.WarnContext(ctx, "rescue pass failed", slog.Any("err", err))
		}
		cancel()
	}
}
