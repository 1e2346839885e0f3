package handlers_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type events chan pool.JobEvent

func (e events) JobFinished(ev pool.JobEvent) { e <- ev }

func TestSleepHandler(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	evs := make(events, 10)
	p, err := pool.New(db, pool.Config{PollInterval: 50 * time.Millisecond, Observer: evs,
		RetryBackoff: func(int) time.Duration { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	if err := handlers.Register(p, handlers.Options{}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ids := map[string]int64{}
	for name, payload := range map[string]string{
		"ok":       `{"duration":"10ms"}`,
		"fail":     `{"duration":"10ms","fail":"nope"}`,
		"bad":      `{"duration":"soon"}`,
		"progress": `{"duration":"50ms","progress":true}`,
		"noop":     `{}`,
	} {
		kind := "sleep"
		if name == "noop" {
			kind = "noop"
		}
		id, err := pool.Insert(ctx, db, kind, []byte(payload), &pool.InsertOpts{MaxAttempts: 2})
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = id
	}
	go p.Run(ctx)
	defer p.Shutdown(ctx)
	for range 6 { // fail runs twice
		select {
		case <-evs:
		case <-time.After(20 * time.Second):
			t.Fatal("jobs did not finish")
		}
	}
	want := map[string]string{"ok": "completed", "fail": "failed", "bad": "failed", "progress": "completed", "noop": "completed"}
	for name, id := range ids {
		var state, lastErr string
		var attempt int
		var progress []byte
		db.QueryRow(ctx, "SELECT state, attempt, coalesce(last_error, ''), progress FROM leash.jobs WHERE id = $1", id).Scan(&state, &attempt, &lastErr, &progress)
		if state != want[name] {
			t.Errorf("%s: %s (%s)", name, state, lastErr)
		}
		switch name {
		case "fail":
			if attempt != 2 || lastErr != "nope" {
				t.Errorf("fail: attempt %d, %q", attempt, lastErr)
			}
		case "bad":
			if attempt != 1 || !strings.Contains(lastErr, "sleep") || !strings.Contains(lastErr, "duration") {
				t.Errorf("bad: attempt %d, %q", attempt, lastErr)
			}
		case "progress":
			if string(progress) != `{"done": 1}` {
				t.Errorf("progress %s", progress)
			}
		}
	}
}

func TestSleepReturnsCause(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(lease.ErrRevoked)
	err := pool.Sleep(ctx, time.Hour)
	if !errors.Is(err, lease.ErrRevoked) {
		t.Fatalf("got %v", err)
	}
}
