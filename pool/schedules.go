package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
	_ "time/tzdata" // CRON_TZ zones: every worker must read them alike, whatever its host has
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/robfig/cron/v3"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/internal/store"
)

// Schedule is a durable periodic job: a row of leash.schedules. Every worker checks for due
// schedules; whichever first sees a tick due enqueues its job (run_at = the tick) in one
// transaction with advancing the schedule, so each tick is enqueued exactly once, with no leader,
// through restarts of every worker. Ticks missed while no worker ran (or while workers were
// late) are enqueued as one job, for the first missed tick, not as a burst; and no tick is
// enqueued while the job of the schedule's previous tick has not started (available or
// retryable, in the schedule's queue and of its kind: the queue paused or capped, no worker
// serving it, a retry waiting out its backoff): that job, when it starts, stands for every tick
// due meanwhile. A job that has started does not hold the next tick back.
type Schedule struct {
	// Name identifies the schedule (1 to 128 characters).
	Name string
	// Spec says when it fires: a 5-field cron expression (minute hour day-of-month month
	// day-of-week), in UTC unless it starts with CRON_TZ=<IANA zone>; a descriptor (@yearly,
	// @monthly, @weekly, @daily, @hourly); or @every <duration> (Go syntax, at least 100ms),
	// whose ticks stay on a fixed grid from the first one. Across a daylight saving change, a
	// time in the repeated hour fires once (at its first occurrence) and a time in the skipped
	// hour fires at the transition, except in specs whose hour field is every hour (*, @hourly),
	// which follow the real clock.
	Spec string
	// Kind, Payload, Queue, Priority, MaxAttempts and Timeout are those of each job it enqueues,
	// as in Insert.
	Kind        string
	Payload     any
	Queue       string
	Priority    int16
	MaxAttempts int
	Timeout     time.Duration
}

// ScheduleState is a schedule as stored, with what workers recorded about it.
type ScheduleState struct {
	Name        string
	Spec        string
	Kind        string
	Payload     json.RawMessage
	Queue       string
	Priority    int16
	MaxAttempts int
	Timeout     time.Duration
	// NextRunAt is the next tick to enqueue; nil until a worker first sees the schedule.
	NextRunAt *time.Time
	// LastRunAt is the last tick enqueued, LastJobID its job.
	LastRunAt *time.Time
	LastJobID *int64
	// LastError says why the spec was refused (the schedule does not fire until its spec
	// changes) or why the last tick could not be enqueued; empty when fine.
	LastError string
}

// Stopped reports whether the schedule does not fire because its spec was refused.
func (s ScheduleState) Stopped() bool { return s.NextRunAt != nil && !s.NextRunAt.Before(store.Never) }

// ScheduleIntervalDefault is the default Config.ScheduleInterval.
const ScheduleIntervalDefault = time.Second

// MinEvery is the shortest @every interval.
const MinEvery = 100 * time.Millisecond

// tickSpec computes a schedule's ticks.
type tickSpec interface {
	// next returns the first tick after t, or the zero time when there is none.
	next(t time.Time) time.Time
}

// cronSpec computes the ticks of a cron spec on the wall clock of its zone (UTC without
// CRON_TZ). Where the zone's clock changes (daylight saving time), as cron does: a wall-clock time
// that occurs twice (the hour repeated when clocks go back) fires once, at its first occurrence;
// a time that does not occur (the hour skipped when clocks go forward) fires at the transition
// (02:30 in Europe/Paris fires at 03:00 CEST on the day clocks go forward), once however many
// times of the spec the skipped hour held. So a daily job runs once on both days. A spec whose
// hour field is every hour (`*`, as in @hourly) follows the real clock instead: it fires in both
// passes of a repeated hour, and a skipped hour holds none of its times.
type cronSpec struct {
	wall      *cron.SpecSchedule // the spec on a clock without transitions (UTC)
	loc       *time.Location
	everyHour bool
}

func newCronSpec(s *cron.SpecSchedule) cronSpec {
	loc := s.Location
	if loc == time.Local { // no CRON_TZ
		loc = time.UTC
	}
	wall := *s
	wall.Location = time.UTC
	const allHours = 1<<24 - 1
	return cronSpec{wall: &wall, loc: loc, everyHour: s.Hour&allHours == allHours}
}

// maxShift bounds how far a zone's clock moves at a transition (two hours in tzdata's daylight
// saving rules): wall-clock times further apart than this are in the same order as instants.
const maxShift = 3 * time.Hour

func (c cronSpec) next(t time.Time) time.Time {
	if c.loc == time.UTC {
		return c.wall.Next(t.UTC())
	}
	// Walk the spec's wall-clock times from t's own, and keep the first instant after t. Near a
	// transition, wall-clock times and instants may be in different orders, within maxShift:
	// start that much earlier (an instant after t reads an earlier time while the clock repeats
	// an hour) and look that much further.
	slack := func(t time.Time) time.Duration {
		start, end := t.In(c.loc).ZoneBounds()
		if (!start.IsZero() && t.Sub(start) < maxShift) || (!end.IsZero() && end.Sub(t) < maxShift) {
			return maxShift
		}
		return 0
	}
	var best time.Time
	w := wallClock(t, c.loc).Add(-slack(t))
	horizon := w.AddDate(5, 0, 0) // as far as the parser's own search goes
	for {
		w = c.wall.Next(w)
		if w.IsZero() || w.After(horizon) || (!best.IsZero() && w.After(wallClock(best, c.loc).Add(slack(best)))) {
			return best
		}
		for _, i := range c.instants(w) {
			if i.After(t) && (best.IsZero() || i.Before(best)) {
				best = i
			}
		}
	}
}

// instants returns when the spec's wall-clock time w fires: the instant whose clock in c.loc
// reads w; in a repeated hour, the first of the two (both when everyHour); in a skipped hour, the
// transition (none when everyHour).
func (c cronSpec) instants(w time.Time) []time.Time {
	g := time.Date(w.Year(), w.Month(), w.Day(), w.Hour(), w.Minute(), w.Second(), 0, c.loc)
	start, end := g.ZoneBounds()
	// w read with each offset in force around g: the zone before g's, g's own, the one after.
	var offsets []time.Time
	if !start.IsZero() {
		offsets = append(offsets, start.Add(-time.Second))
	}
	offsets = append(offsets, g)
	if !end.IsZero() {
		offsets = append(offsets, end)
	}
	var out []time.Time
	for _, at := range offsets {
		_, off := at.Zone()
		i := time.Unix(w.Unix()-int64(off), 0)
		if wallClock(i, c.loc).Equal(w) && !slices.ContainsFunc(out, i.Equal) {
			out = append(out, i)
		}
	}
	slices.SortFunc(out, time.Time.Compare)
	switch {
	case c.everyHour:
		return out
	case len(out) > 0:
		return out[:1]
	}
	// Skipped: the transition is where the clock jumps over w.
	for _, x := range []time.Time{start, end} {
		if !x.IsZero() && wallClock(x.Add(-time.Second), c.loc).Before(w) && wallClock(x, c.loc).After(w) {
			return []time.Time{x}
		}
	}
	return nil
}

// wallClock is what a clock in loc reads at t, as a time in UTC (a clock without transitions).
func wallClock(t time.Time, loc *time.Location) time.Time {
	l := t.In(loc)
	return time.Date(l.Year(), l.Month(), l.Day(), l.Hour(), l.Minute(), l.Second(), l.Nanosecond(), time.UTC)
}

type everySpec struct{ d time.Duration }

func (e everySpec) next(t time.Time) time.Time { return t.Add(e.d) }

var cronParser = cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// ValidateSpec checks a schedule spec; the error says what is wrong with it.
func ValidateSpec(spec string) error {
	_, err := parseSpec(spec)
	return err
}

func parseSpec(spec string) (tickSpec, error) {
	if len(spec) > 256 || !validName(spec) {
		return nil, errors.New("spec must be at most 256 bytes of valid UTF-8 without NUL")
	}
	// Any run of spaces, tabs or newlines separates fields, as the database's check allows.
	s := strings.Join(strings.Fields(spec), " ")
	if rest, ok := strings.CutPrefix(s, "@every"); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil || rest == "" || rest[0] != ' ' {
			return nil, fmt.Errorf("spec %q: @every needs a duration such as @every 5m", spec)
		}
		if d < MinEvery {
			return nil, fmt.Errorf("spec %q: @every must be at least %s", spec, MinEvery)
		}
		return everySpec{d}, nil
	}
	if strings.HasPrefix(s, "TZ=") {
		return nil, fmt.Errorf("spec %q: write the zone as CRON_TZ=<zone>", spec)
	}
	if strings.Contains(s, "@every") {
		return nil, fmt.Errorf("spec %q: @every takes no zone", spec)
	}
	cs, err := parseCron(s)
	if err != nil {
		return nil, fmt.Errorf("spec %q: %w", spec, err)
	}
	ss, ok := cs.(*cron.SpecSchedule)
	if !ok {
		return nil, fmt.Errorf("spec %q: not a cron expression", spec)
	}
	t := newCronSpec(ss)
	if t.next(time.Now()).IsZero() {
		return nil, fmt.Errorf("spec %q never fires", spec)
	}
	return t, nil
}

// parseCron parses a cron spec; a panic in the parser (on input it did not expect) is an error.
func parseCron(s string) (sched cron.Schedule, err error) {
	defer func() {
		if r := recover(); r != nil {
			sched, err = nil, fmt.Errorf("the cron parser failed on it: %s", clean.Text(describe(r), 200))
		}
	}()
	return cronParser.Parse(s)
}

func (s Schedule) row() (store.ScheduleRow, error) {
	switch {
	case s.Name == "" || utf8.RuneCountInString(s.Name) > 128 || !validName(s.Name):
		return store.ScheduleRow{}, fmt.Errorf("%w: schedule name must be 1 to 128 characters of valid UTF-8 without NUL", ErrInvalidJob)
	}
	if err := ValidateSpec(s.Spec); err != nil {
		return store.ScheduleRow{}, fmt.Errorf("%w: schedule %s: %v", ErrInvalidJob, s.Name, err)
	}
	p, err := params(s.Kind, s.Payload, &InsertOpts{Queue: s.Queue, Priority: s.Priority, MaxAttempts: s.MaxAttempts, Timeout: s.Timeout})
	if err != nil {
		return store.ScheduleRow{}, fmt.Errorf("schedule %s: %w", s.Name, err)
	}
	payload := p.Payload
	if payload != nil {
		if payload, err = store.CleanJSON(payload); err != nil {
			return store.ScheduleRow{}, fmt.Errorf("%w: schedule %s: payload: %v", ErrInvalidJob, s.Name, err)
		}
	}
	return store.ScheduleRow{Name: s.Name, Spec: strings.TrimSpace(s.Spec), Kind: p.Kind, Payload: payload, Queue: p.Queue,
		Priority: p.Priority, MaxAttempts: p.MaxAttempts, Timeout: p.Timeout}, nil
}

// UpsertSchedule adds a schedule, or updates the one of that name. A changed spec takes effect
// from its own next tick; an unchanged schedule is left as it is (its next tick stands).
func UpsertSchedule(ctx context.Context, db DB, s Schedule) error {
	row, err := s.row()
	if err != nil {
		return err
	}
	return store.UpsertSchedule(ctx, db, row)
}

// RemoveSchedule deletes a schedule; false when there was none. Jobs it enqueued stay.
func RemoveSchedule(ctx context.Context, db DB, name string) (bool, error) {
	return store.RemoveSchedule(ctx, db, name)
}

// ListSchedules returns every schedule by name.
func ListSchedules(ctx context.Context, db DB) ([]ScheduleState, error) {
	rows, err := store.ListSchedules(ctx, db)
	if err != nil {
		return nil, err
	}
	out := make([]ScheduleState, len(rows))
	for i, r := range rows {
		out[i] = ScheduleState{Name: r.Name, Spec: r.Spec, Kind: r.Kind, Payload: r.Payload, Queue: r.Queue,
			Priority: r.Priority, MaxAttempts: int(r.MaxAttempts), Timeout: r.Timeout, NextRunAt: r.NextRunAt,
			LastRunAt: r.LastRunAt, LastJobID: r.LastJobID, LastError: deref(r.LastError)}
	}
	return out, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// specCache keeps parsed specs by text: a schedule's spec is parsed once per worker.
type specCache struct {
	mu sync.Mutex
	m  map[string]specResult
}

type specResult struct {
	spec tickSpec
	err  error
}

func (c *specCache) parse(spec string) (tickSpec, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r, ok := c.m[spec]; ok {
		return r.spec, r.err
	}
	if c.m == nil || len(c.m) > 10000 {
		c.m = map[string]specResult{}
	}
	s, err := parseSpec(spec)
	c.m[spec] = specResult{s, err}
	return s, err
}

// decideTick says what to do with a schedule found due at now (database clock).
func decideTick(spec tickSpec, row store.ScheduleRow, now time.Time) store.Tick {
	if row.NextRunAt == nil {
		return store.Tick{Next: spec.next(now)} // first sight: fire from the next tick on
	}
	tick := *row.NextRunAt
	if tick.Before(now.AddDate(-100, 0, 0)) {
		// Not a tick any worker set (-infinity, or a date typed in by hand): start afresh.
		return store.Tick{Next: spec.next(now)}
	}
	next := spec.next(tick)
	if !next.After(now) {
		// Ticks were missed: this one job stands for all of them; go on from the next tick to come.
		if e, ok := spec.(everySpec); ok {
			// At most 100 years of ticks missed, each at least MinEvery: no overflow.
			next = tick.Add((now.Sub(tick)/e.d + 1) * e.d)
		} else {
			next = spec.next(now)
		}
	}
	return store.Tick{Enqueue: true, Next: next}
}

// runSchedules upserts Config.Schedules, then enqueues due ticks until ctx is done: after each
// pass it sleeps until the earliest schedule is due, at most ScheduleInterval.
func (p *Pool) runSchedules(ctx context.Context) {
	if p.cfg.ScheduleInterval < 0 {
		return
	}
	for i := 0; i < len(p.cfg.Schedules); {
		err := UpsertSchedule(ctx, p.control(), p.cfg.Schedules[i])
		if err == nil {
			i++
			continue
		}
		if ctx.Err() != nil {
			return
		}
		p.log.WarnContext(ctx, "storing a configured schedule failed; retrying", slog.String("schedule", p.cfg.Schedules[i].Name), slog.Any("err", err))
		if !sleepCtx(ctx, p.cfg.ScheduleInterval) {
			return
		}
	}
	var specs specCache
	// idle: the last look found no tick due before the sleep that followed it ended, so the next
	// one looks before it opens a pass's transaction (one statement a ScheduleInterval while no
	// tick is due, rather than a transaction and a statement).
	idle := false
	for {
		wait := p.cfg.ScheduleInterval
		var more bool
		var err error
		if !idle {
			more, err = p.scheduleOnceSafely(ctx, &specs)
		}
		idle = false
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			p.log.WarnContext(ctx, "enqueueing scheduled jobs failed", slog.Any("err", err))
		case more:
			wait = 0
		default:
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			in, ok, err := store.NextScheduleIn(sctx, p.control(), wait)
			cancel()
			if err == nil {
				idle = !ok || in >= wait
				if ok {
					wait = min(wait, in)
				}
			}
		}
		if !sleepCtx(ctx, wait) {
			return
		}
	}
}

const schedulesPerPass = 100

// scheduleOnceSafely is scheduleOnce, with a panic (a bug, or input nothing expected) turned into
// a failed pass: schedules must never take the worker down.
func (p *Pool) scheduleOnceSafely(ctx context.Context, specs *specCache) (more bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			p.metrics.ScheduleErrors.Add(1)
			more, err = false, fmt.Errorf("enqueue scheduled jobs: panic: %s", clean.Text(describe(r), 512))
		}
	}()
	return p.scheduleOnce(ctx, specs)
}

// scheduleOnce handles the schedules due now, in one transaction; more reports a full batch.
func (p *Pool) scheduleOnce(ctx context.Context, specs *specCache) (more bool, err error) {
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var enqueued int
	err = pgx.BeginFunc(sctx, p.control(), func(tx pgx.Tx) error {
		rows, now, err := store.DueSchedules(sctx, tx, schedulesPerPass)
		if err != nil {
			return err
		}
		more = len(rows) == schedulesPerPass
		for _, row := range rows {
			spec, perr := specs.parse(row.Spec)
			var t store.Tick
			if perr != nil {
				t = store.Tick{Err: perr.Error()}
			} else {
				t = decideTick(spec, row, now)
			}
			if t.Err == "" && t.Next.IsZero() {
				t = store.Tick{Err: fmt.Sprintf("spec %q has no tick after %s", row.Spec, now.UTC().Format(time.RFC3339))}
			}
			if t.Err != "" {
				p.metrics.ScheduleErrors.Add(1)
				p.log.ErrorContext(ctx, "schedule refused; it stays stopped until its spec changes",
					slog.String("schedule", safeName(row.Name)), slog.String("err", clean.Text(t.Err, 512)))
			}
			id, folded, err := store.ApplyTick(sctx, tx, row, t)
			if err != nil {
				if sctx.Err() != nil {
					return err
				}
				// This tick is skipped (or, if even that cannot be written, the schedule is
				// stopped with the error): the others of the pass are not held up.
				p.metrics.ScheduleErrors.Add(1)
				p.log.ErrorContext(ctx, "enqueueing a scheduled job failed; skipping this tick",
					slog.String("schedule", safeName(row.Name)), slog.Any("err", err))
				if err := store.SkipTick(sctx, tx, row.Name, t.Next, err.Error()); err != nil {
					return err
				}
				continue
			}
			if folded {
				p.log.DebugContext(ctx, "schedule tick folded into its previous job, which has not started",
					slog.String("schedule", safeName(row.Name)), slog.Int64("job_id", *row.LastJobID), slog.Time("tick", *row.NextRunAt))
			}
			if id != 0 {
				enqueued++
				p.log.DebugContext(ctx, "scheduled job enqueued", slog.String("schedule", safeName(row.Name)),
					slog.Int64("job_id", id), slog.Time("tick", *row.NextRunAt))
			}
		}
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("enqueue scheduled jobs: %w", err)
	}
	p.metrics.ScheduledJobs.Add(int64(enqueued))
	return more, nil
}

// safeName bounds a name read from the database for a log line.
func safeName(s string) string { return clean.Text(s, 128) }

// sleepCtx waits d or until ctx is done; false when ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
