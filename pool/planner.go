package pool

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/leashq/leash/internal/store"
)

// PlannerStatsIntervalDefault is the default Config.PlannerStatsInterval.
const PlannerStatsIntervalDefault = time.Second

// runPlannerStats keeps the planner's statistics of leash.jobs within a factor of two of its
// size (see store.RefreshJobsStats), so that the generic plans of outcome batches and renewals
// are made again as the table grows, not only when autovacuum gets to it.
func (p *Pool) runPlannerStats(ctx context.Context) {
	if p.cfg.PlannerStatsInterval < 0 {
		return
	}
	missing := false
	for sleepCtx(ctx, p.cfg.PlannerStatsInterval) {
		start := time.Now()
		analyzed, err := store.RefreshJobsStats(ctx, controlDB{p})
		var pgErr *pgconn.PgError
		switch {
		case err != nil && errors.As(err, &pgErr) && pgErr.Code == "42883":
			if !missing {
				missing = true
				p.log.WarnContext(ctx, "leash.refresh_jobs_stats is missing: apply the schema migrations (worker migrate); autovacuum alone keeps leash.jobs analyzed until then")
			}
		case err != nil && ctx.Err() == nil:
			p.log.DebugContext(ctx, "refreshing the statistics of leash.jobs failed", slog.Any("err", err))
		case analyzed:
			missing = false
			p.log.DebugContext(ctx, "analyzed leash.jobs, which had outgrown its statistics", slog.Duration("took", time.Since(start)))
		default:
			missing = false
		}
	}
}
