package pool_test

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/pool"
)

// fleet starts n pools on db, each with its own connections and listener, as worker processes
// would have, and waits until all of them wait for work and may be picked by an insert.
func fleet(t *testing.T, db *pgxpool.Pool, n int, cfg pool.Config, handlers map[string]pool.Handler) ([]*pool.Pool, *bundle) {
	t.Helper()
	ps := make([]*pool.Pool, n)
	b := &bundle{db: db, events: make(events, 100000)}
	for i := range ps {
		c := cfg
		c.Observer = b.events
		ps[i], _ = setup(t, db, c, handlers)
		start(t, ps[i])
	}
	waitPickable(t, db, n)
	return ps, b
}

// waitPickable waits until n registrations may be picked by an insert.
func waitPickable(t *testing.T, db *pgxpool.Pool, n int) {
	t.Helper()
	waitFor(t, 20*time.Second, func() bool {
		var k int
		db.QueryRow(context.Background(), `SELECT count(*) FROM leash.waiters
			WHERE expires_at > now() AND wake_channel IS NOT NULL AND woken_at IS NULL`).Scan(&k)
		return k == n
	})
}

// settle waits until no pool has claimed for 150ms: past the claims that follow a registration
// (at 1, 2, 4, ... 32 ms), only a wake-up or the poll makes a waiting pool claim.
func settle(t *testing.T, ps []*pool.Pool) {
	t.Helper()
	last, since := claims(ps), time.Now()
	waitFor(t, 20*time.Second, func() bool {
		if now := claims(ps); !slices.Equal(now, last) {
			last, since = now, time.Now()
		}
		return time.Since(since) >= 150*time.Millisecond
	})
}

// claims returns every pool's claim count.
func claims(ps []*pool.Pool) []int64 {
	out := make([]int64, len(ps))
	for i, p := range ps {
		out[i] = p.Stats().Claims
	}
	return out
}

func wakes(ps []*pool.Pool) (n int64) {
	for _, p := range ps {
		n += p.Stats().Listener.Wakes
	}
	return n
}

// Eight pools wait on one queue; one insert wakes one of them, and only that one claims: the
// others hear nothing (their poll is a minute away). A second insert, once the first pool waits
// again, wakes one pool again.
func TestOneInsertWakesOnePool(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	count := listen(t, url)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 8, cfg, map[string]pool.Handler{"noop": noop()})
	for round := range 2 {
		count()
		settle(t, ps)
		before := claims(ps)
		w := wakes(ps)
		insert(t, db, "noop", nil, nil)
		b.events.wait(t, 1, 10*time.Second)
		// The woken pool claims again and registers again; the others stay as they were.
		waitPickable(t, db, 8)
		settle(t, ps)
		after := claims(ps)
		claimed := 0
		for i := range ps {
			if after[i] != before[i] {
				claimed++
			}
		}
		if claimed != 1 {
			t.Fatalf("round %d: %d of 8 waiting pools claimed after one insert, want 1", round, claimed)
		}
		if n := wakes(ps) - w; n != 1 {
			t.Fatalf("round %d: %d wakes for one insert, want 1", round, n)
		}
		if n := count(); n != 0 {
			t.Fatalf("round %d: %d job_available notifications, want none (every pool would claim)", round, n)
		}
	}
}

// A multi-row insert wakes enough pools for its rows: with two free slots each and handlers
// that hold their slot, five rows need three pools, and all five start although the poll is a
// minute away.
func TestMultiRowInsertWakesEnoughPools(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.Concurrency = 2
	cfg.PollInterval = time.Minute
	release := make(chan struct{})
	var running atomic.Int64
	ps, _ := fleet(t, db, 5, cfg, map[string]pool.Handler{"hold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		running.Add(1)
		<-release
		return nil
	})})
	defer close(release)
	settle(t, ps) // past the claims that follow each registration, which would find jobs unwoken
	params := make([]pool.InsertManyParams, 5)
	for i := range params {
		params[i].Kind = "hold"
	}
	if _, err := pool.InsertMany(ctx, db, params); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool { return running.Load() == 5 })
	if n := wakes(ps); n != 3 {
		t.Fatalf("%d wakes for five rows and two free slots per pool, want 3", n)
	}
}

// A registration whose worker no longer hears its wakes (stopped, or gone without
// unregistering: here a row whose channel nobody listens on, first in the order inserts pick)
// strands no job: it is picked once, the job is found by another waiter's poll within one poll
// interval, and it is not picked again, so the next insert wakes a live pool at once.
func TestDeafWaiterIsPickedOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO leash.waiters (queue, waiter, expires_at, wake_channel, slots)
		VALUES ('default', '', now() + interval '1 hour', 'leash_wake_00000000000000ff', 10)`); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	// Long enough that a start well inside it (the second job) can only have come from a wake,
	// however slow a loaded machine claims.
	cfg.PollInterval = 4 * time.Second
	started := make(chan time.Time, 10)
	ps, _ := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": pool.HandlerFunc(func(context.Context, *pool.Job) error {
		started <- time.Now()
		return nil
	})})
	waitPickable(t, db, 2)
	settle(t, ps)
	insert(t, db, "noop", nil, nil)
	inserted := time.Now()
	select {
	case at := <-started:
		if d := at.Sub(inserted); d > cfg.PollInterval+2*time.Second {
			t.Fatalf("the job whose wake went to a deaf waiter started after %s; the poll (%s) should bound it", d, cfg.PollInterval)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the job whose wake went to a deaf waiter never started")
	}
	if n := ps[0].Stats().Listener.Wakes; n != 0 {
		t.Fatalf("the live pool heard %d wakes for an insert that picked the deaf waiter", n)
	}
	settle(t, ps)
	waitPickable(t, db, 1) // the live pool waits again; the deaf one stays picked
	insert(t, db, "noop", nil, nil)
	inserted = time.Now()
	select {
	case at := <-started:
		if d := at.Sub(inserted); d > cfg.PollInterval/2 {
			t.Fatalf("the second job started after %s: its wake went to the deaf waiter again", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("second job never started")
	}
	waitFor(t, 5*time.Second, func() bool { return ps[0].Stats().Listener.Wakes == 1 })
}

// Notifications on a pool's wake channel from anyone who learnt it: garbage payloads are counted
// and change nothing; a flood naming its queue makes it claim a bounded number of times, not
// once per notification, and work still starts at once afterwards.
func TestForgedWakesAreHarmless(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	ps, b := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	p := ps[0]
	var ch string
	if err := db.QueryRow(ctx, `SELECT wake_channel FROM leash.waiters`).Scan(&ch); err != nil {
		t.Fatal(err)
	}
	for _, payload := range []string{"", "other", "default ", "{\"queue\":\"default\"}", "\x01"} {
		if _, err := db.Exec(ctx, `SELECT pg_notify($1, $2)`, ch, payload); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Listener.WakesIgnored == 5 })
	before := p.Stats().Claims
	const flood = 400
	began := time.Now()
	for range flood {
		if _, err := db.Exec(ctx, `SELECT pg_notify($1, 'default')`, ch); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // spread out, so that each could be a claim of its own
	}
	waitFor(t, 10*time.Second, func() bool { return p.Stats().Listener.Wakes == flood })
	// Held back, the flood may make a claim per wake for the first few, then one per hold as
	// the holds double up to their cap (100ms), for as long as the flood lasted, which a loaded
	// machine stretches: one claim per wake would be far more.
	limit := int64(4 + 21 + time.Since(began)/(100*time.Millisecond) + 10)
	if n := p.Stats().Claims - before; n > limit {
		t.Fatalf("%d claims for %d forged wakes over %s; they should be held back (at most %d)", n, flood, time.Since(began), limit)
	}
	waitPickable(t, db, 1)
	insert(t, db, "noop", nil, nil)
	b.events.wait(t, 1, 5*time.Second) // the poll is a minute away
}

// A worker of the previous release registers with the previous statements and hears only
// job_available: while it waits, inserts into its queue notify job_available as before, and the
// pools of this release hear it too and pick the job up.
func TestPreviousReleaseWaiterIsStillWoken(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	count := listen(t, url)
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	_, b := fleet(t, db, 2, cfg, map[string]pool.Handler{"noop": noop()})
	if err := store.RegisterWaiter(ctx, db, "old-release", []string{"default"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	count()
	insert(t, db, "noop", nil, nil)
	b.events.wait(t, 1, 10*time.Second)
	if n := count(); n != 1 {
		t.Fatalf("%d job_available notifications for one insert while a previous-release worker waits, want 1", n)
	}
}

// A picked pool whose claim finds nothing (another worker took the job first) may be picked
// again at once, not only after its next poll.
func TestPickedPoolThatFindsNothingWaitsAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval = time.Minute
	ps, _ := fleet(t, db, 1, cfg, map[string]pool.Handler{"noop": noop()})
	settle(t, ps)
	var ch string
	// As an insert that picked it does, for a job another worker then took.
	if err := db.QueryRow(ctx, `UPDATE leash.waiters SET woken_at = now() RETURNING wake_channel`).Scan(&ch); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT pg_notify($1, 'default')`, ch); err != nil {
		t.Fatal(err)
	}
	waitPickable(t, db, 1)
}
