package pool_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A worker whose claim took every slot it asked for lets slots free up for ClaimGather before it
// claims again (one claim for many jobs rather than one per freed slot), but never longer, and
// not at all once every slot is free.
func TestClaimGather(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name       string
		gather     time.Duration
		releaseAll bool
	}{
		{"one slot frees: the claim waits for the gather", 400 * time.Millisecond, false},
		{"every slot frees: the claim goes at once", time.Second, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg := fastConfig()
			// The poll is far off: only the gather's own timer (or the freed slots) may start
			// the third job.
			cfg.Concurrency, cfg.Engine.ClaimGather, cfg.PollInterval = 2, c.gather, time.Minute
			started := make(chan int64, 3)
			release := map[int64]chan struct{}{}
			db := pgtest.Pool(t)
			var ids []int64
			for range 3 {
				id := insert(t, db, "hold", nil, nil)
				ids = append(ids, id)
				release[id] = make(chan struct{})
			}
			p, _ := setup(t, db, cfg, map[string]pool.Handler{"hold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
				started <- j.ID
				select {
				case <-release[j.ID]:
				case <-ctx.Done():
				}
				return nil
			})})
			start(t, p)
			first := []int64{recvID(t, started), recvID(t, started)}
			if first[0] == ids[2] || first[1] == ids[2] {
				t.Fatalf("started %v first; want the first two jobs in claim order", first)
			}
			released := time.Now()
			close(release[first[0]])
			if c.releaseAll {
				close(release[first[1]])
			}
			third := recvID(t, started)
			waited := time.Since(released)
			close(release[third])
			if !c.releaseAll {
				close(release[first[1]])
			}
			switch {
			case third != ids[2]:
				t.Fatalf("third job started: %d; want %d", third, ids[2])
			case !c.releaseAll && waited < c.gather-50*time.Millisecond:
				t.Fatalf("third job started %s after a slot freed; the claim should have gathered for %s", waited, c.gather)
			case c.releaseAll && waited > c.gather/2:
				t.Fatalf("third job started %s after every slot freed; it should not wait for the gather (%s)", waited, c.gather)
			}
		})
	}
}

func recvID(t *testing.T, ch <-chan int64) int64 {
	t.Helper()
	select {
	case id := <-ch:
		return id
	case <-time.After(20 * time.Second):
		t.Fatal("no job started")
		return 0
	}
}

// With two claims in flight, each for half of the slots, every job still runs exactly once, at
// its first attempt, and never more at once than the pool's slots.
func TestTwoClaimsInFlight(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.Concurrency, cfg.Engine.ClaimsInFlight = 16, 2
	db := pgtest.Pool(t)
	const n = 4000
	params := make([]pool.InsertManyParams, n)
	for i := range params {
		params[i].Kind = "count"
	}
	if _, err := pool.InsertMany(context.Background(), db, params); err != nil {
		t.Fatal(err)
	}
	var running, most atomic.Int64
	p, b := setup(t, db, cfg, map[string]pool.Handler{"count": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		now := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
		}
		return nil
	})})
	start(t, p)
	b.events.wait(t, n, 60*time.Second)
	var completed, extra int
	if err := db.QueryRow(context.Background(), `
		SELECT count(*) FILTER (WHERE state = 'completed' AND attempt = 1), count(*) FILTER (WHERE state <> 'completed' OR attempt <> 1)
		FROM leash.jobs`).Scan(&completed, &extra); err != nil {
		t.Fatal(err)
	}
	if completed != n || extra != 0 {
		t.Fatalf("%d completed at attempt 1, %d otherwise; want all %d once", completed, extra, n)
	}
	if m := most.Load(); m > int64(cfg.Concurrency) {
		t.Fatalf("%d handlers ran at once; the pool has %d slots", m, cfg.Concurrency)
	}
	if got := p.Stats().Claimed; got != n {
		t.Fatalf("claimed %d; want %d", got, n)
	}
}

// A notification that arrives while a claim runs, when that claim then fails, still makes the
// worker claim again at once, not at the next poll.
func TestWakeDuringFailedClaimIsKept(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	// The first claim that leases a row waits 300ms, then fails.
	if _, err := db.Exec(ctx, `
		CREATE SEQUENCE claim_failures;
		CREATE FUNCTION fail_first_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF nextval('public.claim_failures') = 1 THEN
				PERFORM pg_sleep(0.3);
				RAISE EXCEPTION 'the first claim fails';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER fail_first_claim BEFORE UPDATE ON leash.jobs FOR EACH ROW
			WHEN (NEW.state = 'running') EXECUTE FUNCTION fail_first_claim()`); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.PollInterval, cfg.Engine.WaitAfter = 4*time.Second, time.Millisecond
	started := make(chan int64, 2)
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"noop": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started <- j.ID
		return nil
	})})
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { // idle, and registered for notifications
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.waiters WHERE expires_at > now()`).Scan(&n)
		return n == 1
	})
	insert(t, db, "noop", nil, nil)
	waitFor(t, 10*time.Second, func() bool { // the failing claim is running
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'`).Scan(&n)
		return n == 1
	})
	// An insert notifies a waiter that another insert picked only within a second of that pick
	// (a waiter picked longer ago that has not claimed since is taken for gone: sql/019): on a
	// loaded machine reaching this point can take longer than that, and the insert below would
	// then notify nobody, which is not what this test is about. Mark the pick as just made.
	if _, err := db.Exec(ctx, `UPDATE leash.waiters SET woken_at = now() WHERE woken_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	insert(t, db, "noop", nil, nil) // notifies while the claim runs
	began := time.Now()
	recvID(t, started)
	recvID(t, started)
	if d := time.Since(began); d > cfg.PollInterval/2 {
		t.Fatalf("the jobs started %s after the notification; the worker should have claimed again at once, not waited for the poll (%s)", d, cfg.PollInterval)
	}
}
