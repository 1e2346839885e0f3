package pool_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// ticks returns the run_at of every job the schedule's kind has, in order.
func ticks(t *testing.T, db *pgxpool.Pool, kind string) []time.Time {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT run_at FROM leash.jobs WHERE kind = $1 ORDER BY run_at`, kind)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []time.Time
	for rows.Next() {
		var ts time.Time
		if err := rows.Scan(&ts); err != nil {
			t.Fatal(err)
		}
		out = append(out, ts)
	}
	return out
}

// startsOf returns when each job of the schedule's kind first started (the far future for one
// that has not), in the order of their run_at.
func startsOf(t *testing.T, db *pgxpool.Pool, kind string) []time.Time {
	t.Helper()
	rows, err := db.Query(context.Background(),
		`SELECT coalesce(attempted_at, 'infinity') FROM leash.jobs WHERE kind = $1 ORDER BY run_at`, kind)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []time.Time
	for rows.Next() {
		var ts pgtype.Timestamptz
		if err := rows.Scan(&ts); err != nil {
			t.Fatal(err)
		}
		if ts.InfinityModifier != pgtype.Finite {
			out = append(out, time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC))
		} else {
			out = append(out, ts.Time)
		}
	}
	return out
}

func scheduleConfig(s ...pool.Schedule) pool.Config {
	cfg := fastConfig()
	cfg.ScheduleInterval = 10 * time.Millisecond
	cfg.Schedules = s
	return cfg
}

// Three pools race on one schedule for many ticks: every tick is enqueued exactly once, on the
// schedule's grid, with no duplicate and no gap.
func TestScheduleExactlyOnceAcrossPools(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	const every = 300 * time.Millisecond
	s := pool.Schedule{Name: "beat", Spec: "@every 300ms", Kind: "beat", Payload: map[string]string{"from": "schedule"}}
	for range 3 {
		p, _ := setup(t, db, scheduleConfig(s), map[string]pool.Handler{"beat": noop()})
		start(t, p)
	}
	waitFor(t, 30*time.Second, func() bool { return len(ticks(t, db, "beat")) >= 12 })
	got := ticks(t, db, "beat")
	started := startsOf(t, db, "beat")
	for i := 1; i < len(got); i++ {
		d := got[i].Sub(got[i-1])
		if d <= 0 || d%every != 0 {
			t.Fatalf("ticks %d and %d are %s apart; want a multiple of %s, on the grid (ticks %v)", i-1, i, d, every, got)
		}
		// A gap is a tick folded into the job before it, which only a job not started by then
		// may take (on a loaded machine a job can start more than a period late).
		if missed := got[i-1].Add(every); d > every && started[i-1].Before(missed) {
			t.Fatalf("ticks %d and %d are %s apart, yet the job of tick %d started at %s, before the tick of %s it would have taken (ticks %v)",
				i-1, i, d, i-1, started[i-1], missed, got)
		}
	}
	var payloadOK bool
	if err := db.QueryRow(context.Background(),
		`SELECT bool_and(payload = '{"from":"schedule"}') FROM leash.jobs WHERE kind = 'beat'`).Scan(&payloadOK); err != nil || !payloadOK {
		t.Fatalf("scheduled jobs' payload: %v, %v", payloadOK, err)
	}
	list, err := pool.ListSchedules(context.Background(), db)
	if err != nil || len(list) != 1 || list[0].LastJobID == nil || list[0].LastRunAt == nil || list[0].NextRunAt == nil {
		t.Fatalf("ListSchedules = %+v, %v", list, err)
	}
}

// A schedule survives restarts of every worker: the ticks missed while none ran are enqueued as
// one job, and the schedule goes on on its grid. (A tick whose previous job has not started is
// folded into it, which also leaves a gap: the ticks are far enough apart that a loaded machine
// starts each job before the next tick.)
func TestScheduleSurvivesRestarts(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	const every = 500 * time.Millisecond
	s := pool.Schedule{Name: "r", Spec: "@every 500ms", Kind: "r"}
	for round := range 2 {
		p, _ := setup(t, db, scheduleConfig(s), map[string]pool.Handler{"r": noop()})
		done := make(chan error, 1)
		go func() { done <- p.Run(context.Background()) }()
		want := 3 * (round + 1)
		waitFor(t, 20*time.Second, func() bool { return len(ticks(t, db, "r")) >= want })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		p.Shutdown(ctx)
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if round == 0 {
			time.Sleep(6 * every) // no worker runs for several ticks
		}
	}
	got := ticks(t, db, "r")
	long := 0
	for i := 1; i < len(got); i++ {
		d := got[i].Sub(got[i-1])
		if d%every != 0 || d == 0 {
			t.Fatalf("ticks %s apart: off the grid or duplicated (%v)", d, got)
		}
		if d > every {
			long++
		}
	}
	if long != 1 {
		t.Fatalf("%d gaps longer than one tick; want exactly one, for the time no worker ran (%v)", long, got)
	}
}

// Bad specs: refused with a message by the Go API and by New; the database refuses garbage; a
// well-formed spec the worker cannot use stops that schedule alone, is recorded and counted, and
// a corrected spec re-arms it.
func TestBadSchedules(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, spec := range []string{"", "hello", "61 * * * *", "* * * *", "CRON_TZ=Mars/Olympus 0 9 * * *",
		"@every 1ms", "@every soon", "@everyday", "TZ=UTC 0 0 * * *", "0 0 30 2 *", "0 0 * * *\x00", "\xff * * * *"} {
		err := pool.UpsertSchedule(ctx, db, pool.Schedule{Name: "x", Spec: spec, Kind: "k"})
		if !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("spec %q: %v; want ErrInvalidJob", spec, err)
		}
	}
	for _, spec := range []string{"CRON_TZ=Europe/Berlin 0 9 * * 1-5", "@daily", "*/5 * * * *", "@every 1h30m"} {
		if err := pool.ValidateSpec(spec); err != nil {
			t.Errorf("spec %q refused: %v", spec, err)
		}
	}
	if _, err := pool.New(db, scheduleConfig(pool.Schedule{Name: "n", Spec: "61 * * * *", Kind: "k"})); err == nil {
		t.Error("New accepted a bad schedule")
	}
	if err := pool.UpsertSchedule(ctx, db, pool.Schedule{Name: "a\x00", Spec: "@daily", Kind: "k"}); err == nil {
		t.Error("a name with NUL accepted")
	}

	var pe *pgconn.PgError
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind) VALUES ('garbage', 'hello', 'k')`); !errors.As(err, &pe) || pe.Code != "23514" {
		t.Fatalf("garbage spec from SQL: %v; want a check violation", err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind) VALUES
		('bad', '99 * * * *', 'bad'), ('good', '@every 150ms', 'good')`); err != nil {
		t.Fatal(err)
	}
	p, _ := setup(t, db, scheduleConfig(), map[string]pool.Handler{"good": noop(), "bad": noop()})
	start(t, p)
	waitFor(t, 20*time.Second, func() bool { return len(ticks(t, db, "good")) >= 3 })
	list, err := pool.ListSchedules(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(list, func(s pool.ScheduleState) bool { return s.Name == "bad" })
	if i < 0 || !list[i].Stopped() || list[i].LastError == "" {
		t.Fatalf("bad schedule: %+v; want stopped with its error", list)
	}
	if n := len(ticks(t, db, "bad")); n != 0 || p.Stats().ScheduleErrors == 0 {
		t.Fatalf("bad schedule enqueued %d jobs, errors counted %d", n, p.Stats().ScheduleErrors)
	}
	if _, err := db.Exec(ctx, `UPDATE leash.schedules SET spec = '@every 150ms' WHERE name = 'bad'`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return len(ticks(t, db, "bad")) >= 2 })
	if ok, err := pool.RemoveSchedule(ctx, db, "bad"); !ok || err != nil {
		t.Fatalf("RemoveSchedule = %v, %v", ok, err)
	}
}

// Rows no Go API would write cannot take the scheduler down or hold other schedules back: a
// spec separated by tabs, a next_run_at of -infinity or centuries ago, an infinite updated_at.
func TestHostileScheduleRows(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.ValidateSpec("CRON_TZ=UTC\t0\t3\t*\t*\t*"); err != nil {
		t.Fatalf("tab-separated spec: %v", err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind) VALUES ('tabs', e'CRON_TZ=UTC\t0\t3\t*\t*\t*', 'k')`); err == nil {
		t.Fatal("the database accepted a zone followed by a tab")
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind, next_run_at, updated_at, created_at) VALUES
		('tabs', e'CRON_TZ=UTC 0\t3 *\t*  *', 'k', NULL, now(), now()),
		('ancient', '@every 1h', 'ancient', '1700-01-01', now(), now()),
		('minus', '@every 1h', 'minus', '-infinity', now(), now()),
		('forever', '@every 150ms', 'forever', NULL, 'infinity', '-infinity'),
		('healthy', '@every 150ms', 'healthy', NULL, now(), now())`); err != nil {
		t.Fatal(err)
	}
	p, _ := setup(t, db, scheduleConfig(), map[string]pool.Handler{"healthy": noop(), "forever": noop()})
	start(t, p)
	waitFor(t, 20*time.Second, func() bool { return len(ticks(t, db, "healthy")) >= 3 && len(ticks(t, db, "forever")) >= 3 })
	for _, kind := range []string{"ancient", "minus"} {
		if n := len(ticks(t, db, kind)); n != 0 {
			t.Errorf("schedule %s with a nonsense next_run_at enqueued %d jobs; want none until its next tick", kind, n)
		}
	}
	list, err := pool.ListSchedules(ctx, db)
	if err != nil || len(list) != 5 {
		t.Fatalf("ListSchedules: %d, %v", len(list), err)
	}
	for _, s := range list {
		if s.Stopped() || s.NextRunAt == nil || s.NextRunAt.Before(time.Now().Add(-time.Minute)) {
			t.Errorf("schedule %s: next %v, stopped %v, error %q", s.Name, s.NextRunAt, s.Stopped(), s.LastError)
		}
	}
}

// A schedule enqueues no tick while the job of its previous tick has not started: the ticks due
// while its queue is paused fold into that one job, which runs once on resume; a job that has
// started does not hold the next tick back, but that next one, waiting for the only slot, does.
func TestScheduleTicksFoldWhileTheirJobWaits(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := pool.PauseQueue(ctx, db, "fold"); err != nil {
		t.Fatal(err)
	}
	cfg := scheduleConfig(pool.Schedule{Name: "fold", Spec: "@every 100ms", Kind: "fold", Queue: "fold"})
	cfg.Queues, cfg.Concurrency = []string{"fold"}, 1
	started, release := make(chan int64, 100), make(chan struct{})
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"fold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started <- j.ID
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	})})
	start(t, p)
	defer close(release)
	jobs := func() int64 { return count(t, db, `SELECT count(*) FROM leash.jobs WHERE kind = 'fold'`) }
	// ticksSince counts the schedule's ticks since a time (SQL on the job of id $1).
	ticksSince := func(since string, id int64) int64 {
		return count(t, db, `SELECT coalesce((SELECT floor(extract(epoch FROM s.next_run_at - `+since+`) * 10)::bigint
			FROM leash.schedules s, leash.jobs j WHERE s.name = 'fold' AND j.id = $1), 0)`, id)
	}
	var first int64
	waitFor(t, 20*time.Second, func() bool {
		first = count(t, db, `SELECT coalesce(min(id), 0) FROM leash.jobs WHERE kind = 'fold'`)
		return first != 0 && ticksSince("j.run_at", first) >= 10
	})
	if n := jobs(); n != 1 {
		t.Fatalf("%d jobs after 10 ticks of a paused queue; want 1", n)
	}
	if _, err := pool.ResumeQueue(ctx, db, "fold"); err != nil {
		t.Fatal(err)
	}
	if id := <-started; id != first { // the first job runs and holds the only slot
		t.Fatalf("job %d started; want %d", id, first)
	}
	waitFor(t, 20*time.Second, func() bool { return ticksSince("j.attempted_at", first) >= 10 })
	if n := jobs(); n != 2 {
		t.Fatalf("%d jobs after 10 ticks behind a running job; want 2 (it and one waiting)", n)
	}
	if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE kind = 'fold' AND state = 'running'`); n != 1 {
		t.Fatalf("%d jobs running; want 1", n)
	}
}

// A tick is not folded into a job an operator postponed past it: the schedule goes on firing.
func TestScheduleTickNotFoldedIntoPostponedJob(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := pool.PauseQueue(ctx, db, "post"); err != nil {
		t.Fatal(err)
	}
	cfg := scheduleConfig(pool.Schedule{Name: "post", Spec: "@every 100ms", Kind: "post", Queue: "post"})
	cfg.Queues = []string{"post"}
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"post": noop()})
	start(t, p)
	waitFor(t, 20*time.Second, func() bool { return count(t, db, `SELECT count(*) FROM leash.jobs WHERE kind = 'post'`) == 1 })
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET run_at = now() + interval '1 year' WHERE kind = 'post'`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return count(t, db, `SELECT count(*) FROM leash.jobs WHERE kind = 'post'`) >= 2 })
}
