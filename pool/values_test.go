package pool_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A row no claim can lease, in one of a worker's queues (an attempt counter at the largest
// integer, in a row older than the check that now refuses it), is set aside and counted; the
// worker's other queues and the rest of that queue run. It used to make every claim of the
// worker fail, from the front, forever.
func TestUnclaimableRowIsSetAside(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	mustExec(t, db, `ALTER TABLE leash.jobs DROP CONSTRAINT jobs_attempt_room_check`)
	var stuck int64
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (queue, kind, attempt, max_attempts, priority)
		VALUES ('a', 'noop', 2147483647, 2147483647, -1) RETURNING id`).Scan(&stuck); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db, `ALTER TABLE leash.jobs ADD CONSTRAINT jobs_attempt_room_check
		CHECK (attempt < 2147483647 OR state NOT IN ('available', 'retryable')) NOT VALID`)
	cfg := fastConfig()
	cfg.Queues = []string{"a", "b"}
	p, b := setup(t, db, cfg, map[string]pool.Handler{"noop": noop()})
	for _, q := range []string{"a", "b", "a", "b"} {
		insert(t, db, "noop", nil, &pool.InsertOpts{Queue: q})
	}
	start(t, p)
	for _, ev := range b.events.wait(t, 4, 20*time.Second) {
		if ev.State != "completed" {
			t.Fatalf("job ended %s: %+v", ev.State, ev)
		}
	}
	r := getRow(t, db, stuck)
	if r.State != "failed" || r.LastError == nil || !strings.Contains(*r.LastError, "no room for another claim") {
		t.Fatalf("unclaimable row: state %s, last_error %v", r.State, r.LastError)
	}
	if n := p.Stats().SetAside; n != 1 {
		t.Fatalf("SetAside = %d, want 1", n)
	}
}

// Every timeout interval the table's check lets in limits the job as the check reads it, end to
// end: each of these is 50ms to the check (30-day months, 24-hour days), however it mixes years,
// months, days and microseconds, and each job is cancelled with ErrTimeout at about 50ms,
// whatever the kind's default. Read with 365.25-day years, the first two meant minus 126 hours
// (no limit at all, the kind's default skipped too) and plus 126 hours.
func TestHostileTimeoutIntervalsLimitTheJob(t *testing.T) {
	t.Parallel()
	intervals := []string{
		"-1 year 361 days -23:59:59.95",
		"1 year -359 days -23:59:59.95",
		"100 years -36000 days 0.05 seconds",
		"-5000000 years 1800000000 days 0.05 seconds",
		"1 mon -29 days -23:59:59.95",
		"1 day -86399950000 microseconds",
	}
	db := pgtest.Pool(t)
	cfg := fastConfig()
	cfg.Timeouts = map[string]time.Duration{"block": time.Hour} // the kind's default must not apply
	blk := newBlocker()
	p, b := setup(t, db, cfg, map[string]pool.Handler{"block": blk})
	ids := map[int64]string{}
	for _, iv := range intervals {
		var id int64
		if err := db.QueryRow(context.Background(), `INSERT INTO leash.jobs (kind, timeout, max_attempts)
			VALUES ('block', $1::interval, 1) RETURNING id`, iv).Scan(&id); err != nil {
			t.Fatalf("insert timeout %q: %v", iv, err)
		}
		ids[id] = iv
	}
	start(t, p)
	for range intervals {
		c := blk.cause(t)
		if !errors.Is(c.cause, pool.ErrTimeout) || c.cause.Error() != "job timed out after 50ms" {
			t.Errorf("timeout %q: handler cancelled with %v, want a 50ms timeout", ids[c.id], c.cause)
		}
	}
	b.events.wait(t, len(intervals), 20*time.Second)
	for id, iv := range ids {
		if r := getRow(t, db, id); r.State != "failed" || r.LastError == nil || *r.LastError != "job timed out after 50ms" {
			t.Errorf("timeout %q: state %s, last_error %v", iv, r.State, r.LastError)
		}
	}
}

// A revocation by bare NOTIFY is stored as one message naming it once; it used to read
// "revoked: job revoked: revoked by NOTIFY job_revoked".
func TestRevokedByNotifyStoredOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	blk := newBlocker()
	p, b := setup(t, db, slowHeartbeat(), map[string]pool.Handler{"block": blk})
	start(t, p)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	id := insert(t, db, "block", nil, nil)
	blk.next(t)
	mustExec(t, db, fmt.Sprintf("NOTIFY job_revoked, '%d'", id))
	blk.cause(t)
	b.events.wait(t, 1, 20*time.Second)
	var reason, lastError string
	if err := db.QueryRow(context.Background(), `SELECT revoke_reason, last_error FROM leash.jobs WHERE id = $1`, id).
		Scan(&reason, &lastError); err != nil {
		t.Fatal(err)
	}
	if reason != "by NOTIFY job_revoked" || lastError != "job revoked: by NOTIFY job_revoked" {
		t.Fatalf("revoke_reason %q, last_error %q", reason, lastError)
	}
}
