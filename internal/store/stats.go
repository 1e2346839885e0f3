package store

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
)

// statsLockKey is the advisory lock a worker holds while it samples minutes ("leashst" in ASCII),
// so that one worker at a time does it and the others skip their turn.
const statsLockKey = 0x6c656173687374

// Defaults of SampleParams.
const (
	// SampleLagDefault is how long after a minute ends it is sampled: outcomes are stamped with
	// their transaction's start time, so a minute's last outcomes may commit a little after it.
	SampleLagDefault = 5 * time.Second
	// SampleBackfillDefault is how many closed minutes a sample fills in at most: the chart's hour.
	SampleBackfillDefault = 60
	// SampleRetainDefault is how long sampled minutes are kept.
	SampleRetainDefault = 24 * time.Hour
)

// SampleParams tune SampleMinutes.
type SampleParams struct {
	// Now replaces the database clock (for tests). Zero: now() of the database.
	Now time.Time
	// Lag: a minute is sampled once this long has passed since it ended. Default
	// SampleLagDefault.
	Lag time.Duration
	// Backfill is the number of closed minutes, the latest first, that are filled in when they
	// have no row yet. Default SampleBackfillDefault.
	Backfill int
	// Retain: rows for minutes older than this are deleted. Default SampleRetainDefault.
	Retain time.Duration
}

// SampleMinutes writes a leash.minute_stats row for every closed minute of the last p.Backfill
// that has none (normally just the minute that ended last): jobs finished in it by state, the
// attempts started in it and their pickup latency, and, for the latest minute only, the queue
// depth read now. It deletes rows older than p.Retain. One worker at a time samples: when another
// holds the turn, SampleMinutes returns 0 at once. It returns the number of rows written.
//
// Finished counts and pickup latency are counted from the rows of leash.jobs as they are when
// the minute is sampled, so a minute filled in late (no worker ran in time) misses jobs deleted by
// retention meanwhile and attempts followed by another attempt of the same job; its depth is left
// NULL, since the rows cannot tell a past depth.
func SampleMinutes(ctx context.Context, db Beginner, p SampleParams) (int, error) {
	if p.Lag <= 0 {
		p.Lag = SampleLagDefault
	}
	if p.Backfill <= 0 {
		p.Backfill = SampleBackfillDefault
	}
	if p.Retain <= 0 {
		p.Retain = SampleRetainDefault
	}
	var now *time.Time
	if !p.Now.IsZero() {
		now = &p.Now
	}
	written := 0
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		written = 0
		var mine bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, int64(statsLockKey)).Scan(&mine); err != nil {
			return fmt.Errorf("take the sampling turn: %w", err)
		}
		if !mine {
			return nil
		}
		// The minutes to fill in, oldest first, and the clock they were judged by.
		var (
			at, latest time.Time
			missing    []time.Time
		)
		err := tx.QueryRow(ctx, `
			WITH c AS (SELECT coalesce($1::timestamptz, now()) AS at),
			b AS (SELECT at, date_trunc('minute', at - $2 * interval '1 millisecond') - interval '1 minute' AS last FROM c)
			SELECT b.at, b.last, coalesce(array_agg(m ORDER BY m) FILTER (WHERE s.minute IS NULL), '{}')
			FROM b CROSS JOIN generate_series(b.last - ($3 - 1) * interval '1 minute', b.last, interval '1 minute') m
			LEFT JOIN leash.minute_stats s ON s.minute = m
			GROUP BY b.at, b.last`, now, millis(p.Lag), p.Backfill).Scan(&at, &latest, &missing)
		if err != nil {
			return fmt.Errorf("find minutes to sample: %w", err)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM leash.minute_stats WHERE minute < $1::timestamptz - $2 * interval '1 millisecond'`,
			at, millis(p.Retain)); err != nil {
			return fmt.Errorf("prune sampled minutes: %w", err)
		}
		if len(missing) == 0 {
			return nil
		}
		var queued, runnable *int64
		if missing[len(missing)-1].Equal(latest) {
			// The depth now, for the minute that has just ended. The claimable index holds exactly
			// these rows (available or retryable).
			if err := tx.QueryRow(ctx, `
				SELECT count(*), count(*) FILTER (WHERE run_at <= $1)
				FROM leash.jobs WHERE state IN ('available', 'retryable')`, at).Scan(&queued, &runnable); err != nil {
				return fmt.Errorf("read queue depth: %w", err)
			}
		}
		tag, err := tx.Exec(ctx, sampleMinutesSQL, missing, missing[0], missing[len(missing)-1].Add(time.Minute),
			latest, queued, runnable, at)
		if err != nil {
			return fmt.Errorf("sample minutes: %w", err)
		}
		written = int(tag.RowsAffected())
		return nil
	})
	if err != nil {
		return 0, err
	}
	return written, nil
}

// sampleMinutesSQL: $1 the minutes to write, $2..$3 the time range they cover, $4 the latest
// minute (which gets the depth $5, $6), $7 the sampling time.
//
// Each part reads through an index: finished jobs through jobs_finished_idx (a range of
// finished_at; a job attempted in the range and finished since finished after its attempt
// began), running ones through jobs_running_idx. Pickup is measured only where the row still
// tells when the attempt became runnable (run_at <= attempted_at): an attempt that ended in a
// retry, a hand-back or a rescue had its run_at moved past it, so queued jobs are left out.
const sampleMinutesSQL = `
	WITH fin AS (
		SELECT date_trunc('minute', finished_at) AS m,
		       count(*) FILTER (WHERE state = 'completed') AS completed,
		       count(*) FILTER (WHERE state = 'failed') AS failed,
		       count(*) FILTER (WHERE state = 'cancelled') AS cancelled
		FROM leash.jobs
		WHERE state IN ('completed', 'failed', 'cancelled') AND finished_at >= $2 AND finished_at < $3
		GROUP BY 1
	), att AS (
		SELECT attempted_at, run_at, created_at FROM leash.jobs
		WHERE state IN ('completed', 'failed', 'cancelled') AND finished_at >= $2
		  AND attempted_at >= $2 AND attempted_at < $3 AND run_at <= attempted_at
		UNION ALL
		SELECT attempted_at, run_at, created_at FROM leash.jobs
		WHERE state = 'running' AND attempted_at >= $2 AND attempted_at < $3 AND run_at <= attempted_at
	), pick AS (
		SELECT date_trunc('minute', attempted_at) AS m, count(*) AS started,
		       -- Rows with an infinite run_at or created_at (any SQL client may write them) have no
		       -- pickup: subtracting infinity fails the statement, and with it every minute's row.
		       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY
		           CASE WHEN isfinite(run_at) AND isfinite(created_at)
		                THEN greatest(extract(epoch FROM attempted_at - greatest(run_at, created_at)), 0) * 1000 END) AS p
		FROM att GROUP BY 1
	)
	INSERT INTO leash.minute_stats (minute, completed, failed, cancelled, started, pickup_p50_ms, pickup_p99_ms,
	                                queued, runnable, sampled_at)
	SELECT t.m, coalesce(fin.completed, 0), coalesce(fin.failed, 0), coalesce(fin.cancelled, 0),
	       coalesce(pick.started, 0), pick.p[1], pick.p[2],
	       CASE WHEN t.m = $4 THEN $5::bigint END, CASE WHEN t.m = $4 THEN $6::bigint END, $7
	FROM unnest($1::timestamptz[]) AS t(m)
	LEFT JOIN fin ON fin.m = t.m
	LEFT JOIN pick ON pick.m = t.m
	ON CONFLICT (minute) DO NOTHING`

// MinuteStats is one minute of the admin page's charts.
type MinuteStats struct {
	// Minute starts the minute covered: [Minute, Minute+1m).
	Minute time.Time
	// Sampled: a row exists for the minute. Without one (no worker sampled it) every other field
	// is zero and the charts show a gap.
	Sampled bool
	// Jobs finished in the minute, by final state.
	Completed, Failed, Cancelled int64
	// Started counts the attempts that began in the minute and whose pickup latency the rows
	// still tell (the latest attempt of jobs running or finished when the minute was sampled);
	// PickupP50 and PickupP99 are the percentiles of that latency, nil when Started is 0.
	Started              int64
	PickupP50, PickupP99 *time.Duration
	// Queued (available or retryable) and Runnable (of those, run_at passed) as read when the
	// minute was sampled, shortly after it ended; nil when it was filled in later.
	Queued, Runnable *int64
}

// ReadStatsParams select the minutes ReadMinuteStats returns.
type ReadStatsParams struct {
	// Now replaces the database clock (for tests). Zero: now() of the database.
	Now time.Time
	// Minutes is how many minutes to return, ending with the last whole minute before Now.
	// Default 60.
	Minutes int
}

// ReadMinuteStats returns p.Minutes consecutive minutes, oldest first, ending with the last
// whole minute; minutes without a row are returned with Sampled false.
func ReadMinuteStats(ctx context.Context, db DBTX, p ReadStatsParams) ([]MinuteStats, error) {
	if p.Minutes <= 0 {
		p.Minutes = 60
	}
	var now *time.Time
	if !p.Now.IsZero() {
		now = &p.Now
	}
	rows, err := db.Query(ctx, `
		WITH b AS (SELECT date_trunc('minute', coalesce($1::timestamptz, now())) - interval '1 minute' AS last)
		SELECT m, s.minute IS NOT NULL, coalesce(s.completed, 0), coalesce(s.failed, 0), coalesce(s.cancelled, 0),
		       coalesce(s.started, 0), s.pickup_p50_ms, s.pickup_p99_ms, s.queued, s.runnable
		FROM b CROSS JOIN generate_series(b.last - ($2 - 1) * interval '1 minute', b.last, interval '1 minute') m
		LEFT JOIN leash.minute_stats s ON s.minute = m
		ORDER BY m`, now, p.Minutes)
	if err != nil {
		return nil, fmt.Errorf("read minute stats: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (MinuteStats, error) {
		var s MinuteStats
		var p50, p99 *float64
		err := r.Scan(&s.Minute, &s.Sampled, &s.Completed, &s.Failed, &s.Cancelled, &s.Started, &p50, &p99, &s.Queued, &s.Runnable)
		s.PickupP50, s.PickupP99 = msDuration(p50), msDuration(p99)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("read minute stats: %w", err)
	}
	return out, nil
}

func msDuration(ms *float64) *time.Duration {
	if ms == nil {
		return nil
	}
	// A pickup from a run_at thousands of years back is longer than a Duration holds.
	d := time.Duration(math.MaxInt64)
	if *ms < float64(math.MaxInt64/int64(time.Millisecond)) {
		d = time.Duration(*ms * float64(time.Millisecond))
	}
	return &d
}
