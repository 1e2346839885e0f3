package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// The wait until the next schedule is bounded whatever next_run_at holds: a date past 2262
// (beyond a time.Duration), 9999-12-31 (how Never reads), 'infinity' (stopped: no wait at all),
// '-infinity' (due).
func TestNextScheduleInFarFuture(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const limit = 5 * time.Second
	for _, c := range []struct {
		next   string // SQL for next_run_at; "" for no row at all
		want   time.Duration
		armed  bool
		within time.Duration
	}{
		{"", 0, false, 0},
		{"'infinity'", 0, false, 0},
		{"'2400-01-01'", limit, true, 0},
		{"'9999-12-31'", limit, true, 0},
		{"now() + interval '1 hour'", limit, true, 0},
		{"now() + interval '2 seconds'", 2 * time.Second, true, time.Second},
		{"now() - interval '1 hour'", 0, true, 0},
		{"'-infinity'", 0, true, 0},
		{"NULL", 0, true, 0},
	} {
		if _, err := db.Exec(ctx, `DELETE FROM leash.schedules`); err != nil {
			t.Fatal(err)
		}
		if c.next != "" {
			if _, err := db.Exec(ctx, `INSERT INTO leash.schedules (name, spec, kind, next_run_at)
				VALUES ('s', '@every 1h', 'k', `+c.next+`)`); err != nil {
				t.Fatal(err)
			}
		}
		in, armed, err := store.NextScheduleIn(ctx, db, limit)
		if err != nil || armed != c.armed || in < c.want-c.within || in > c.want {
			t.Errorf("next_run_at %s: %s, armed %v, %v; want %s (less up to %s), armed %v", c.next, in, armed, err, c.want, c.within, c.armed)
		}
	}
}
