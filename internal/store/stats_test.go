package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// statsRow is one job placed at known times for the minute statistics.
type statsRow struct {
	state                         string
	created, runAt, attempted, at string // at: finished_at; "" for NULL
}

func insertStatsRows(t *testing.T, db store.DBTX, rows []statsRow) {
	t.Helper()
	ctx := context.Background()
	for _, r := range rows {
		nullable := func(s string) any {
			if s == "" {
				return nil
			}
			return s
		}
		_, err := db.Exec(ctx, `
			INSERT INTO leash.jobs (kind, state, created_at, run_at, attempted_at, finished_at, attempt,
			                        lease_token, lease_expires_at, heartbeat_at)
			VALUES ('k', $1, $2, $3, $4, $5, 1,
			        CASE WHEN $1 = 'running' THEN 1 END, CASE WHEN $1 = 'running' THEN $4::timestamptz + interval '1 hour' END,
			        CASE WHEN $1 = 'running' THEN $4::timestamptz END)`,
			r.state, r.created, r.runAt, nullable(r.attempted), nullable(r.at))
		if err != nil {
			t.Fatalf("insert %+v: %v", r, err)
		}
	}
}

func ts(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t
}

func ms(n float64) time.Duration { return time.Duration(n * float64(time.Millisecond)) }

// Known rows give known minutes: finished counts by state, empty minutes as zeros, the edges of
// the hour (a job finished a moment before the first sampled minute is in none), pickup
// percentiles from running and finished jobs only, and the depth for the latest minute alone.
func TestSampleMinutes(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	insertStatsRows(t, db, []statsRow{
		// Before the sampled hour (09:00 to 09:59): counted nowhere.
		{"completed", "2026-03-01T08:59:00Z", "2026-03-01T08:59:00Z", "2026-03-01T08:59:01Z", "2026-03-01T08:59:59.999Z"},
		// The first minute, from its first microsecond.
		{"completed", "2026-03-01T08:59:58Z", "2026-03-01T08:59:58Z", "2026-03-01T08:59:59Z", "2026-03-01T09:00:00Z"},
		// 09:10: two completed (pickups 100 ms and 300 ms), one failed (pickup 200 ms; its run_at
		// a scheduled time after created_at), one cancelled before it ever ran (no attempt).
		{"completed", "2026-03-01T09:10:00Z", "2026-03-01T09:10:00Z", "2026-03-01T09:10:00.1Z", "2026-03-01T09:10:01Z"},
		{"completed", "2026-03-01T09:10:00Z", "2026-03-01T09:10:00Z", "2026-03-01T09:10:00.3Z", "2026-03-01T09:10:02Z"},
		{"failed", "2026-03-01T09:00:00Z", "2026-03-01T09:10:10Z", "2026-03-01T09:10:10.2Z", "2026-03-01T09:10:59.999999Z"},
		{"cancelled", "2026-03-01T09:00:00Z", "2026-03-01T09:30:00Z", "", "2026-03-01T09:10:30Z"},
		// Attempted in 09:20, still running: its pickup (400 ms) counts in 09:20.
		{"running", "2026-03-01T09:20:00Z", "2026-03-01T09:20:00Z", "2026-03-01T09:20:00.4Z", ""},
		// Attempted in 09:20, now waiting for a retry: its run_at moved on, so its pickup is unknown.
		{"retryable", "2026-03-01T09:20:00Z", "2026-03-01T09:25:00Z", "2026-03-01T09:20:00.5Z", ""},
		// Queued: the depth. One runnable at sampling time, one scheduled for later.
		{"available", "2026-03-01T09:50:00Z", "2026-03-01T09:50:00Z", "", ""},
		{"available", "2026-03-01T09:50:00Z", "2026-03-01T11:00:00Z", "", ""},
		// The last closed minute, up to its end.
		{"completed", "2026-03-01T09:59:59Z", "2026-03-01T09:59:59Z", "2026-03-01T09:59:59.5Z", "2026-03-01T09:59:59.999999Z"},
		// The minute in progress: not sampled yet.
		{"completed", "2026-03-01T10:00:00Z", "2026-03-01T10:00:00Z", "2026-03-01T10:00:00Z", "2026-03-01T10:00:00Z"},
	})

	// Five seconds after 10:00 the minute 09:59 is not yet due (its last outcomes may still be
	// committing); seven seconds after, it is, with the 59 before it.
	n, err := store.SampleMinutes(ctx, db, store.SampleParams{Now: ts("2026-03-01T10:00:04Z")})
	if err != nil || n != 60 {
		t.Fatalf("first sample: %d rows, %v; want 60 (09:59 not due yet)", n, err)
	}
	n, err = store.SampleMinutes(ctx, db, store.SampleParams{Now: ts("2026-03-01T10:00:07Z")})
	if err != nil || n != 1 {
		t.Fatalf("second sample: %d rows, %v; want 1 (09:59)", n, err)
	}
	if n, err = store.SampleMinutes(ctx, db, store.SampleParams{Now: ts("2026-03-01T10:00:09Z")}); err != nil || n != 0 {
		t.Fatalf("again: %d rows, %v; want 0", n, err)
	}

	got, err := store.ReadMinuteStats(ctx, db, store.ReadStatsParams{Now: ts("2026-03-01T10:00:30Z")})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 60 || !got[0].Minute.Equal(ts("2026-03-01T09:00:00Z")) || !got[59].Minute.Equal(ts("2026-03-01T09:59:00Z")) {
		t.Fatalf("%d minutes from %v to %v", len(got), got[0].Minute, got[len(got)-1].Minute)
	}
	byMinute := map[string]store.MinuteStats{}
	for _, s := range got {
		if !s.Sampled {
			t.Errorf("%v not sampled", s.Minute)
		}
		byMinute[s.Minute.UTC().Format("15:04")] = s
	}
	total := int64(0)
	for _, s := range got {
		total += s.Completed + s.Failed + s.Cancelled
	}
	if total != 6 {
		t.Errorf("%d jobs finished in the hour, want 6", total)
	}
	check := func(minute string, completed, failed, cancelled, started int64) store.MinuteStats {
		t.Helper()
		s := byMinute[minute]
		if s.Completed != completed || s.Failed != failed || s.Cancelled != cancelled || s.Started != started {
			t.Errorf("%s: completed %d failed %d cancelled %d started %d; want %d %d %d %d",
				minute, s.Completed, s.Failed, s.Cancelled, s.Started, completed, failed, cancelled, started)
		}
		return s
	}
	check("09:00", 1, 0, 0, 0)
	check("09:30", 0, 0, 0, 0) // empty minute: zeros, not a gap
	if s := byMinute["09:30"]; s.PickupP50 != nil || s.Queued != nil {
		t.Errorf("09:30: pickup %v, queued %v; want none", s.PickupP50, s.Queued)
	}
	s := check("09:10", 2, 1, 1, 3)
	// percentile_cont over 100, 200, 300 ms: p50 200 ms, p99 at rank 1.98: 298 ms.
	if s.PickupP50 == nil || s.PickupP99 == nil || (*s.PickupP50-ms(200)).Abs() > time.Microsecond ||
		(*s.PickupP99-ms(298)).Abs() > time.Microsecond {
		t.Errorf("09:10 pickup %v %v, want 200ms 298ms", s.PickupP50, s.PickupP99)
	}
	s = check("09:20", 0, 0, 0, 1)
	if s.PickupP50 == nil || (*s.PickupP50-ms(400)).Abs() > time.Microsecond {
		t.Errorf("09:20 pickup %v, want 400ms (the running job only)", s.PickupP50)
	}
	s = check("09:59", 1, 0, 0, 1)
	if s.Queued == nil || s.Runnable == nil || *s.Queued != 3 || *s.Runnable != 2 {
		t.Errorf("09:59 depth %v/%v, want 3 queued, 2 runnable", s.Queued, s.Runnable)
	}
	// 09:58 was the latest minute of the first sample and has a depth; those before it were
	// filled in after the fact and have none.
	if s := byMinute["09:58"]; s.Queued == nil || *s.Queued != 3 {
		t.Errorf("09:58: depth %v, want 3", s.Queued)
	}
	if s := byMinute["09:57"]; s.Queued != nil {
		t.Errorf("09:57 was filled in later: depth %v, want none", *s.Queued)
	}

	// Later, with minutes nobody sampled: they read as gaps, not zeros.
	got, err = store.ReadMinuteStats(ctx, db, store.ReadStatsParams{Now: ts("2026-03-01T10:03:00Z"), Minutes: 5})
	if err != nil {
		t.Fatal(err)
	}
	var sampled []bool
	for _, s := range got {
		sampled = append(sampled, s.Sampled)
	}
	if len(got) != 5 || !got[0].Minute.Equal(ts("2026-03-01T09:58:00Z")) || sampled[0] != true || sampled[1] != true || sampled[2] || sampled[3] || sampled[4] {
		t.Fatalf("minutes after the samples: %v", sampled)
	}

	// A day later the old rows are pruned.
	if _, err := store.SampleMinutes(ctx, db, store.SampleParams{Now: ts("2026-03-02T10:00:07Z"), Backfill: 1}); err != nil {
		t.Fatal(err)
	}
	var left int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.minute_stats WHERE minute < '2026-03-01T10:00:07Z'`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d rows older than a day left, %v", left, err)
	}
}

// Workers sampling at once write each minute once: one takes the turn, the others skip.
func TestSampleMinutesConcurrently(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	now := ts("2026-03-01T10:00:07Z")
	var wg sync.WaitGroup
	counts := make([]int, 6)
	for i := range counts {
		wg.Go(func() {
			n, err := store.SampleMinutes(ctx, db, store.SampleParams{Now: now})
			if err != nil {
				t.Error(err)
			}
			counts[i] = n
		})
	}
	wg.Wait()
	sum := 0
	for _, n := range counts {
		sum += n
	}
	var rows int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM leash.minute_stats`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if sum != 60 || rows != 60 {
		t.Fatalf("written %v (sum %d), %d rows; want 60 once", counts, sum, rows)
	}
}

// The page's status counts the queued and running jobs only; recent failures are the newest
// failed and retryable jobs, newest first, whichever index each comes from.
func TestLiveStatusAndRecentFailures(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	insertStatsRows(t, db, []statsRow{
		{"completed", "2026-03-01T09:00:00Z", "2026-03-01T09:00:00Z", "2026-03-01T09:00:01Z", "2026-03-01T09:00:09Z"},
		{"failed", "2026-03-01T09:00:00Z", "2026-03-01T09:00:00Z", "2026-03-01T09:00:01Z", "2026-03-01T09:00:05Z"}, // 2
		{"retryable", "2026-03-01T09:00:00Z", "2026-03-01T09:10:00Z", "2026-03-01T09:00:07Z", ""},                  // 3
		{"failed", "2026-03-01T09:00:00Z", "2026-03-01T09:00:00Z", "2026-03-01T09:00:01Z", "2026-03-01T09:00:08Z"}, // 4
		{"retryable", "2026-03-01T09:00:00Z", "2026-03-01T09:10:00Z", "2026-03-01T09:00:02Z", ""},                  // 5
		{"cancelled", "2026-03-01T09:00:00Z", "2026-03-01T09:00:00Z", "2026-03-01T09:00:01Z", "2026-03-01T09:00:10Z"},
		{"running", "2026-03-01T09:00:00Z", "2026-03-01T09:00:00Z", "2026-03-01T09:00:01Z", ""},
	})
	got, err := store.RecentFailures(ctx, db, 3)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for _, j := range got {
		ids = append(ids, j.ID)
	}
	if len(ids) != 3 || ids[0] != 4 || ids[1] != 3 || ids[2] != 2 {
		t.Fatalf("recent failures %v, want [4 3 2]", ids)
	}
	st, err := store.ReadLiveStatus(ctx, db, 10)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, c := range st.Counts {
		counts[c.State] += c.Count
	}
	if len(counts) != 2 || counts["retryable"] != 2 || counts["running"] != 1 || len(st.Running) != 1 {
		t.Fatalf("live counts %v, %d running", counts, len(st.Running))
	}
	st, err = store.ReadStatus(ctx, db, 10)
	if err != nil || len(st.Counts) != 5 {
		t.Fatalf("all counts %v, %v", st.Counts, err)
	}
}

// A job list whose filter makes it read too much gives up with ErrListTimeout, not a database
// error; within its time it lists the newest matches first.
func TestListJobsTimeout(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, state, finished_at) SELECT 'noop', 'completed', now() FROM generate_series(1, 200000)`); err != nil {
		t.Fatal(err)
	}
	_, err := store.ListJobs(ctx, db, store.ListParams{Kind: "no-such-kind", Timeout: time.Millisecond})
	if !errors.Is(err, store.ErrListTimeout) {
		t.Fatalf("a kind no job has, 1 ms: %v", err)
	}
	got, err := store.ListJobs(ctx, db, store.ListParams{Kind: "noop", State: "completed", BeforeID: 100, Limit: 3})
	if err != nil || len(got) != 3 || got[0].ID != 99 || got[2].ID != 97 {
		t.Fatalf("list: %v, %v", got, err)
	}
}
