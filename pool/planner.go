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

// plannerStatsIdleMax is the longest a worker that claims nothing goes between calls of
// leash.refresh_jobs_stats (see runPlannerStats).
const plannerStatsIdleMax = 10 * time.Second

// plannerStatsBackoffMax is the longest a worker waits before calling leash.refresh_jobs_stats
// again after failures (the function missing, no right to call it, a statement timeout).
const plannerStatsBackoffMax = time.Minute

// runPlannerStats keeps the planner's statistics of leash.jobs within a factor of two of its
// size (see store.RefreshJobsStats), so that the generic plans of outcome batches and renewals
// are made again as the table grows, not only when autovacuum gets to it. It uses the
// application's pool, not a control connection: an ANALYZE of a large table takes seconds,
// which renewals must not wait for. While the worker claims nothing and its calls analyze
// nothing, it calls less and less often (each time twice as long after the last call, up to
// plannerStatsIdleMax, or the interval if longer), so that an idle worker costs the database
// little while a table that grows with nothing claimed (a paused queue, jobs for later) is still
// analyzed within about ten seconds; a claim brings back a call every interval. After a failure it waits twice as long as the time before
// (up to a minute, or the interval if longer), and it warns once for each kind of failure until
// a call succeeds again.
func (p *Pool) runPlannerStats(ctx context.Context) {
	if p.cfg.PlannerStatsInterval < 0 {
		return
	}
	wait := p.cfg.PlannerStatsInterval
	longest := max(plannerStatsBackoffMax, p.cfg.PlannerStatsInterval)
	idleLongest := max(plannerStatsIdleMax, p.cfg.PlannerStatsInterval)
	idleWait, lastCall, claimed := p.cfg.PlannerStatsInterval, time.Now(), p.metrics.Claimed.Load()
	warned := map[string]bool{} // SQLSTATEs warned about since the last success
	for sleepCtx(ctx, wait) {
		start := time.Now()
		now := p.metrics.Claimed.Load()
		if len(warned) == 0 && now == claimed && start.Sub(lastCall) < idleWait {
			continue // idle: no call yet
		}
		lastCall = start
		analyzed, err := store.RefreshJobsStats(ctx, p.db)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if wait < longest/2 {
				wait *= 2
			} else {
				wait = longest
			}
			code := "other"
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				code = pgErr.Code
			}
			msg := "refreshing the statistics of leash.jobs failed: autovacuum alone keeps them until it works again"
			if code == "42883" {
				msg = "refreshing the statistics of leash.jobs failed: leash.refresh_jobs_stats is missing, apply the schema migrations (worker migrate)"
			}
			level := slog.LevelDebug
			if !warned[code] {
				warned[code], level = true, slog.LevelWarn
			}
			p.log.Log(ctx, level, msg, slog.Any("err", err), slog.Duration("retry_in", wait))
			continue
		}
		if len(warned) > 0 {
			clear(warned)
			p.log.InfoContext(ctx, "refreshing the statistics of leash.jobs works again")
		}
		wait = p.cfg.PlannerStatsInterval
		if now == claimed && !analyzed {
			idleWait = min(2*idleWait, idleLongest)
		} else {
			idleWait, claimed = p.cfg.PlannerStatsInterval, now
		}
		if analyzed {
			p.log.DebugContext(ctx, "analyzed leash.jobs, which had outgrown its statistics", slog.Duration("took", time.Since(start)))
		}
	}
}
