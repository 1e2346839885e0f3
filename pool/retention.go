package pool

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/leashq/leash/internal/store"
)

// Retention defaults.
const (
	RetainCompletedDefault   = 24 * time.Hour
	RetainFailedDefault      = 7 * 24 * time.Hour
	RetentionIntervalDefault = time.Minute
	retentionBatch           = 1000
)

// PruneOnce deletes finished jobs past their retention in batches of a thousand (each batch its
// own short statement, rows locked by another worker skipped), and returns how many it deleted.
func (p *Pool) PruneOnce(ctx context.Context) (int64, error) {
	var total int64
	for _, c := range []struct {
		completed bool
		keep      time.Duration
	}{{true, p.cfg.RetainCompleted}, {false, p.cfg.RetainFailed}} {
		if c.keep < 0 {
			continue // kept forever
		}
		for {
			n, err := store.DeleteFinished(ctx, controlDB{p}, c.completed, c.keep, retentionBatch)
			total += n
			if err != nil {
				return total, err
			}
			if n < retentionBatch {
				break
			}
		}
	}
	return total, nil
}

func (p *Pool) runRetention(ctx context.Context) {
	for {
		d := p.cfg.RetentionInterval
		d += time.Duration(rand.Int64N(int64(d)/5 + 1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
		n, err := p.PruneOnce(ctx)
		if err != nil && ctx.Err() == nil {
			p.log.WarnContext(ctx, "deleting old finished jobs failed", slog.Any("err", err))
		}
		if n > 0 {
			p.metrics.Pruned.Add(n)
			p.log.DebugContext(ctx, "deleted old finished jobs", slog.Int64("jobs", n))
		}
	}
}
