package pool

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

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
// Then it deletes, in batches as well, the rows of workflows that have no jobs left and were
// created longer ago than the shorter of the two retentions (not counted in the result); never
// one a transaction is inserting a job into. It also deletes the recorded starts of the keys of
// queues with a per-key rate limit that have all left their window (leash.key_rates).
func (p *Pool) PruneOnce(ctx context.Context) (total int64, err error) {
	// The starts of keys come last, and whatever befalls them, the rest is done: a failure here
	// (a role without the grant) is joined to the pass's result.
	defer func() {
		for {
			n, kerr := store.DeleteIdleKeyRates(ctx, controlDB{p}, retentionBatch)
			if kerr != nil {
				err = errors.Join(err, kerr)
				return
			}
			if n < retentionBatch {
				return
			}
		}
	}()
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
	// A workflow's row goes once its jobs are gone, and it is older than the shorter retention.
	keep := p.cfg.RetainCompleted
	if keep < 0 || (p.cfg.RetainFailed >= 0 && p.cfg.RetainFailed < keep) {
		keep = p.cfg.RetainFailed
	}
	if keep < 0 {
		return total, nil
	}
	var workflows int64
	defer func() {
		if workflows > 0 {
			p.log.DebugContext(ctx, "deleted the rows of workflows whose jobs are gone", slog.Int64("workflows", workflows))
		}
	}()
	for {
		n, err := store.DeleteEmptyWorkflows(ctx, controlDB{p}, keep, retentionBatch)
		workflows += n
		if err != nil {
			return total, err
		}
		if n < retentionBatch {
			return total, nil
		}
	}
}

func (p *Pool) runRetention(ctx context.Context) {
	warned := map[string]bool{} // SQLSTATEs warned about since the last success
	for {
		d := p.cfg.RetentionInterval
		d += time.Duration(rand.Int64N(int64(d)/5 + 1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
		n, err := p.PruneOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			// A failure that repeats (no right to delete workflows: a role granted before
			// retention deleted them) warns once until a pass succeeds again.
			code := "other"
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				code = pgErr.Code
			}
			level := slog.LevelWarn
			if warned[code] {
				level = slog.LevelDebug
			}
			warned[code] = true
			msg := "deleting old finished jobs failed"
			if code == "42501" {
				msg = "deleting old finished jobs failed: the worker's role lacks a grant (EXECUTE on leash.delete_empty_workflows and leash.delete_idle_key_rates: see the privileges in docs/sql.md)"
			}
			p.log.Log(ctx, level, msg, slog.Any("err", err))
		case err == nil:
			clear(warned)
		}
		if n > 0 {
			p.metrics.Pruned.Add(n)
			p.log.DebugContext(ctx, "deleted old finished jobs", slog.Int64("jobs", n))
		}
	}
}
