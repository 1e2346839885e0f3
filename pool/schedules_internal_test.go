package pool

import (
	"slices"
	"testing"
	"time"

	"github.com/leashq/leash/internal/store"
)

func TestDecideTick(t *testing.T) {
	at := func(s string) time.Time {
		v, err := time.Parse(time.RFC3339, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	ptr := func(v time.Time) *time.Time { return &v }
	spec := func(s string) tickSpec {
		v, err := parseSpec(s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	cases := []struct {
		name, spec string
		next       *time.Time // the row's next_run_at
		now        time.Time
		enqueue    bool
		want       time.Time
	}{
		{"first sight arms the next tick", "0 9 * * *", nil, at("2026-03-01T10:00:00Z"), false, at("2026-03-02T09:00:00Z")},
		{"a zone is honoured", "CRON_TZ=America/New_York 0 9 * * *", nil, at("2026-07-01T10:00:00Z"), false, at("2026-07-01T13:00:00Z")},
		{"on time: the following tick", "0 9 * * *", ptr(at("2026-03-02T09:00:00Z")), at("2026-03-02T09:00:01Z"), true, at("2026-03-03T09:00:00Z")},
		{"days missed: one job, then the next tick to come", "0 9 * * *", ptr(at("2026-03-02T09:00:00Z")), at("2026-03-09T12:00:00Z"), true, at("2026-03-10T09:00:00Z")},
		{"@every stays on its grid", "@every 10m", ptr(at("2026-03-02T09:00:00Z")), at("2026-03-02T09:00:03Z"), true, at("2026-03-02T09:10:00Z")},
		{"@every after missed ticks: next grid point", "@every 10m", ptr(at("2026-03-02T09:00:00Z")), at("2026-03-02T09:35:00Z"), true, at("2026-03-02T09:40:00Z")},
		{"@every exactly on a grid point skips it", "@every 10m", ptr(at("2026-03-02T09:00:00Z")), at("2026-03-02T09:20:00Z"), true, at("2026-03-02T09:30:00Z")},
	}
	for _, c := range cases {
		got := decideTick(spec(c.spec), store.ScheduleRow{NextRunAt: c.next}, c.now)
		if got.Enqueue != c.enqueue || !got.Next.Equal(c.want) {
			t.Errorf("%s: got enqueue=%v next=%s; want enqueue=%v next=%s", c.name, got.Enqueue, got.Next, c.enqueue, c.want)
		}
	}
}

// Cron specs in a zone with daylight saving time: a daily time in the repeated hour fires once
// (its first occurrence), one in the skipped hour fires at the transition; every-hour specs
// follow the real clock. Europe/Paris goes forward on 2026-03-29 at 02:00 (to 03:00) and back on
// 2026-10-25 at 03:00 (to 02:00).
func TestCronAcrossDaylightSaving(t *testing.T) {
	at := func(s string) time.Time {
		v, err := time.Parse(time.RFC3339, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	ticksBetween := func(spec string, from, to time.Time) []time.Time {
		s, err := parseSpec(spec)
		if err != nil {
			t.Fatal(err)
		}
		var out []time.Time
		for tick := s.next(from); !tick.IsZero() && tick.Before(to); tick = s.next(tick) {
			out = append(out, tick)
			if len(out) > 200 {
				break
			}
		}
		return out
	}
	cases := []struct {
		name, spec string
		from, to   string
		want       []string // every tick in [from, to), or just their number in count
		count      int
	}{
		{"daily in the repeated hour: once, at the first 02:30", "CRON_TZ=Europe/Paris 30 2 * * *",
			"2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z", []string{"2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"}, 0},
		{"daily in the skipped hour: at the transition", "CRON_TZ=Europe/Paris 30 2 * * *",
			"2026-03-28T12:00:00Z", "2026-03-30T12:00:00Z", []string{"2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"}, 0},
		{"every 15 minutes of the skipped hour: one tick at the transition", "CRON_TZ=Europe/Paris */15 2 * * *",
			"2026-03-28T12:00:00Z", "2026-03-29T12:00:00Z", []string{"2026-03-29T01:00:00Z"}, 0},
		{"every 15 minutes of the repeated hour: its first pass", "CRON_TZ=Europe/Paris */15 2 * * *",
			"2026-10-24T12:00:00Z", "2026-10-25T12:00:00Z",
			[]string{"2026-10-25T00:00:00Z", "2026-10-25T00:15:00Z", "2026-10-25T00:30:00Z", "2026-10-25T00:45:00Z"}, 0},
		{"from inside the repeated hour's second pass: its first pass had the tick", "CRON_TZ=Europe/Paris 45 2 * * *",
			"2026-10-25T01:30:00Z", "2026-10-26T12:00:00Z", []string{"2026-10-26T01:45:00Z"}, 0},
		{"hourly, from the repeated hour's first pass: its second pass is next", "CRON_TZ=Europe/Paris 45 * * * *",
			"2026-10-25T00:50:00Z", "2026-10-25T02:00:00Z", []string{"2026-10-25T01:45:00Z"}, 0},
		{"the hour after the skipped one is not doubled", "CRON_TZ=Europe/Paris 0 2,3 * * *",
			"2026-03-28T12:00:00Z", "2026-03-29T12:00:00Z", []string{"2026-03-29T01:00:00Z"}, 0},
		{"hourly on the long day: 25 ticks", "CRON_TZ=Europe/Paris 30 * * * *",
			"2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z", nil, 25},
		{"hourly on the short day: 23 ticks", "CRON_TZ=Europe/Paris 30 * * * *",
			"2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z", nil, 23},
		{"@hourly on the long day", "CRON_TZ=Europe/Paris @hourly", "2026-10-24T21:59:00Z", "2026-10-25T23:00:00Z", nil, 25},
		{"@daily: midnight exists on both days", "CRON_TZ=Europe/Paris @daily",
			"2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z", []string{"2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z"}, 0},
		{"New York, repeated 01:30: once", "CRON_TZ=America/New_York 30 1 * * *",
			"2026-10-31T12:00:00Z", "2026-11-02T12:00:00Z", []string{"2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"}, 0},
		{"New York, skipped 02:00: at 03:00 EDT", "CRON_TZ=America/New_York 0 2 * * *",
			"2026-03-07T12:00:00Z", "2026-03-09T12:00:00Z", []string{"2026-03-08T07:00:00Z", "2026-03-09T06:00:00Z"}, 0},
		{"Lord Howe, half an hour skipped: at 02:30", "CRON_TZ=Australia/Lord_Howe 15 2 * * *",
			"2026-10-03T00:00:00Z", "2026-10-04T12:00:00Z", []string{"2026-10-03T15:30:00Z"}, 0},
		{"UTC is untouched", "30 2 * * *", "2026-03-28T12:00:00Z", "2026-03-30T12:00:00Z",
			[]string{"2026-03-29T02:30:00Z", "2026-03-30T02:30:00Z"}, 0},
	}
	for _, c := range cases {
		got := ticksBetween(c.spec, at(c.from), at(c.to))
		if c.want == nil {
			if len(got) != c.count {
				t.Errorf("%s: %d ticks; want %d (%v)", c.name, len(got), c.count, got)
			}
			continue
		}
		var want []time.Time
		for _, w := range c.want {
			want = append(want, at(w))
		}
		if !slices.EqualFunc(got, want, time.Time.Equal) {
			t.Errorf("%s: ticks %v; want %v", c.name, got, want)
		}
	}
}
