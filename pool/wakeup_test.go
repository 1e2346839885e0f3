package pool_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

// listen counts job_available notifications on a connection of its own.
func listen(t *testing.T, url string) func() int {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "LISTEN job_available; LISTEN test_done"); err != nil {
		t.Fatal(err)
	}
	// count sends a sentinel and counts what arrived before it (delivery follows commit order).
	return func() int {
		if _, err := pgtest.PoolFor(t, url).Exec(ctx, "NOTIFY test_done"); err != nil {
			t.Fatal(err)
		}
		n := 0
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			got, err := conn.WaitForNotification(wctx)
			if err != nil {
				t.Fatal(err)
			}
			if got.Channel == "test_done" {
				return n
			}
			n++
		}
	}
}

// A worker that is busy is not waiting for work: inserts into its queue send no notification
// (so they commit without serializing on the notification lock), and it still picks them up as
// its slots free. Once it has found nothing for a while it waits, and an insert wakes it.
func TestOnlyWaitingWorkersAreNotified(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	count := listen(t, url)
	cfg := fastConfig()
	cfg.Concurrency = 2
	cfg.PollInterval = time.Minute // only a notification or a freed slot can start a job
	release := make(chan struct{})
	p, b := setup(t, db, cfg, map[string]pool.Handler{"hold": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		<-release
		return nil
	}), "noop": noop()})
	insert(t, db, "hold", nil, nil)
	insert(t, db, "hold", nil, nil)
	start(t, p)
	waitFor(t, 10*time.Second, func() bool { return p.Busy() == 2 })
	count() // whatever was sent before the worker was busy
	for range 20 {
		insert(t, db, "noop", nil, nil)
	}
	if n := count(); n != 0 {
		t.Fatalf("%d notifications for inserts into a busy worker's queue", n)
	}
	close(release)
	b.events.wait(t, 22, 20*time.Second) // slots freed: it claimed the rest itself
	waitFor(t, 10*time.Second, func() bool {
		var n int
		db.QueryRow(context.Background(), `SELECT count(*) FROM leash.waiters WHERE expires_at > now()`).Scan(&n)
		return n == 1
	})
	insert(t, db, "noop", nil, nil)
	b.events.wait(t, 1, 20*time.Second) // woken by the notification: the poll is a minute away
	// On the worker's own channel: job_available would wake every worker of the queue.
	if n := count(); n != 0 {
		t.Fatalf("%d job_available notifications for one insert into a waiting worker's queue", n)
	}
	if n := p.Stats().Listener.Wakes; n != 1 {
		t.Fatalf("%d wakes for one insert into a waiting worker's queue", n)
	}
}

// An insert whose trigger ran before the worker registered as waiting, and that commits after
// the worker's claim that follows the registration, sends no notification and is not seen by
// that claim: the poll picks it up, within one poll interval.
func TestWaitRaceEndsWithinOnePoll(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PollInterval, cfg.Engine.WaitAfter = 2*time.Second, 20*time.Millisecond
	started := make(chan time.Time, 1)
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"noop": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started <- time.Now()
		return nil
	})})
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := pool.InsertTx(ctx, tx, "noop", nil, nil); err != nil { // nobody waits yet: no NOTIFY
		t.Fatal(err)
	}
	start(t, p)
	waitFor(t, 10*time.Second, func() bool {
		var n int
		db.QueryRow(ctx, `SELECT count(*) FROM leash.waiters WHERE expires_at > now()`).Scan(&n)
		return n == 1
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	select {
	case at := <-started:
		// One jittered poll (+10%), plus the claim itself on a loaded machine. Without the poll
		// it never starts.
		if d := at.Sub(committed); d > cfg.PollInterval+cfg.PollInterval/10+time.Second {
			t.Fatalf("started %s after commit; the poll (%s) should bound it", d, cfg.PollInterval)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("job committed behind the registration never started")
	}
}

// A worker that cannot register as waiting (no rights on leash.waiters, an older schema) polls at
// its poll interval instead, rather than trying again every millisecond.
func TestFailedRegistrationDoesNotSpin(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `
		CREATE FUNCTION leash.no_waiters() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'permission denied for table waiters'; END $$;
		CREATE TRIGGER no_waiters BEFORE INSERT OR UPDATE ON leash.waiters FOR EACH ROW EXECUTE FUNCTION leash.no_waiters()`); err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	cfg := fastConfig()
	cfg.PollInterval = 200 * time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	p, b := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	start(t, p)
	time.Sleep(time.Second) // an idle second: how often does it try?
	if n := strings.Count(logs.String(), "registering as waiting for work failed"); n > 8 {
		t.Fatalf("%d failed registrations in one second with a 200ms poll", n)
	}
	insert(t, db, "noop", nil, nil)
	b.events.wait(t, 1, 10*time.Second) // found by the poll
}

// A worker waits, and is notified, only for the queues it could claim from now: inserts into a
// paused queue, or into a capped queue at its cap, send no notification however many there are
// (each would make its transaction a notifying one). Room freed in the capped queue by a job
// finishing elsewhere (here a plain UPDATE, as another worker's outcome) wakes it at once, and
// so does a resume: the poll is a minute away.
func TestNoWakeUpsForQueuesItCannotClaim(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	count := listen(t, url)
	if _, err := pool.PauseQueue(ctx, db, "held"); err != nil {
		t.Fatal(err)
	}
	if err := pool.SetQueueMaxRunning(ctx, db, "capped", 1); err != nil {
		t.Fatal(err)
	}
	// Another worker runs the capped queue's one job.
	other := insert(t, db, "noop", nil, &pool.InsertOpts{Queue: "capped"})
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(),
		lease_token = nextval('leash.lease_tokens'), leased_by = 'other', lease_expires_at = now() + interval '1 hour'
		WHERE id = $1`, other); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.Queues = []string{"open", "held", "capped"}
	cfg.PollInterval, cfg.Engine.WaitAfter = time.Minute, 20*time.Millisecond
	started := make(chan string, 100)
	p, _ := setup(t, db, cfg, map[string]pool.Handler{"noop": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		started <- j.Queue
		return nil
	})})
	start(t, p)
	registered := func() string {
		var qs string
		db.QueryRow(ctx, `SELECT coalesce(string_agg(queue, ',' ORDER BY queue), '') FROM leash.waiters WHERE expires_at > now()`).Scan(&qs)
		return qs
	}
	waitFor(t, 10*time.Second, func() bool { return registered() == "capped,open" })
	count()
	for range 20 {
		insert(t, db, "noop", nil, &pool.InsertOpts{Queue: "held"})
		insert(t, db, "noop", nil, &pool.InsertOpts{Queue: "capped"})
	}
	if n := count(); n != 0 {
		t.Fatalf("%d notifications for inserts into a paused queue and a capped one at its cap", n)
	}
	expect := func(queue, why string) {
		t.Helper()
		select {
		case q := <-started:
			if q != queue {
				t.Fatalf("%s: a job of %s started, want %s", why, q, queue)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no job started within 5s (the poll is a minute)", why)
		}
	}
	insert(t, db, "noop", nil, &pool.InsertOpts{Queue: "open"})
	expect("open", "an insert into a queue with room")
	waitFor(t, 10*time.Second, func() bool { return registered() == "capped,open" })
	// Past the claims that follow a registration (at 1, 2, 4, ... 32 ms): only a wake-up or the
	// poll claims again.
	time.Sleep(200 * time.Millisecond)
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'completed', finished_at = now(),
		lease_token = NULL, leased_by = NULL, lease_expires_at = NULL WHERE id = $1`, other); err != nil {
		t.Fatal(err)
	}
	expect("capped", "room freed in the capped queue") // and the rest follow, one at a time
	for range 19 {
		expect("capped", "the capped queue's next job")
	}
	if _, err := pool.ResumeQueue(ctx, db, "held"); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		expect("held", "resumed")
	}
}
