package pool

import (
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
