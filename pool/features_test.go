package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// Sixteen producers inserting one key at once leave one job; every other insert is told it is a
// duplicate and gets that job's id. The same holds for SQL clients (ON CONFLICT DO NOTHING),
// inside a transaction (which stays usable) and for InsertMany.
func TestUniqueJobsUnderConcurrentProducers(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for round := range 5 {
		key := "report:" + string(rune('a'+round))
		var wg sync.WaitGroup
		var inserted atomic.Int32
		ids := make([]int64, 16)
		errs := make([]error, 16)
		gate := make(chan struct{})
		for i := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-gate
				ids[i], errs[i] = pool.Insert(ctx, db, "report", map[string]int{"i": i}, &pool.InsertOpts{UniqueKey: key})
				if errs[i] == nil {
					inserted.Add(1)
				}
			}()
		}
		close(gate)
		wg.Wait()
		if inserted.Load() != 1 {
			t.Fatalf("round %d: %d inserts succeeded; want 1 (errors %v)", round, inserted.Load(), errs)
		}
		var winner int64
		for i, err := range errs {
			if err == nil {
				winner = ids[i]
			}
		}
		for i, err := range errs {
			var de *pool.DuplicateError
			if err != nil && (!errors.Is(err, pool.ErrDuplicate) || !errors.As(err, &de) || de.ID != winner || ids[i] != winner) {
				t.Fatalf("round %d: insert %d: id %d, %v; want a duplicate of %d", round, i, ids[i], err, winner)
			}
		}
		if n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE unique_key = $1`, key); n != 1 {
			t.Fatalf("round %d: %d rows hold the key", round, n)
		}
	}

	// A SQL client dedupes with ON CONFLICT DO NOTHING.
	tag, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, unique_key) VALUES ('report', 'report:a') ON CONFLICT DO NOTHING`)
	if err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("SQL insert of a held key: %v, %v; want nothing inserted", tag, err)
	}

	// Inside a transaction the duplicate is an answer, not a failure: the transaction goes on.
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := pool.InsertTx(ctx, tx, "report", nil, &pool.InsertOpts{UniqueKey: "report:a"}); !errors.Is(err, pool.ErrDuplicate) {
			t.Errorf("InsertTx of a held key: %v", err)
		}
		_, err := pool.InsertTx(ctx, tx, "report", nil, &pool.InsertOpts{UniqueKey: "report:tx"})
		return err
	})
	if err != nil {
		t.Fatalf("transaction after a duplicate: %v", err)
	}

	// InsertMany skips what is held, including repeats within the call.
	n, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{
		{Kind: "report", Opts: &pool.InsertOpts{UniqueKey: "m1"}},
		{Kind: "report", Opts: &pool.InsertOpts{UniqueKey: "report:b"}},
		{Kind: "report", Opts: &pool.InsertOpts{UniqueKey: "m1"}},
		{Kind: "report"},
		{Kind: "report", Opts: &pool.InsertOpts{UniqueKey: "m2", Delay: time.Hour}},
	})
	if err != nil || n != 3 {
		t.Fatalf("InsertMany = %d, %v; want 3 inserted", n, err)
	}

	for _, bad := range []pool.InsertOpts{{UniqueKey: "a\x00b"}, {UniqueKey: "\xff"}, {UniqueKey: string(make([]byte, 2000))},
		{UniqueFinishedWithin: time.Hour}, {UniqueKey: "k", UniqueFinishedWithin: -time.Second}} {
		if _, err := pool.Insert(ctx, db, "report", nil, &bad); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("Insert with %+v: %v; want ErrInvalidJob", bad, err)
		}
	}
}

// A unique key is free again once its job has finished, unless the insert asks to dedupe
// against recently finished jobs too.
func TestUniqueKeyFreedOnCompletion(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"noop": noop()})
	start(t, p)
	ctx := context.Background()
	first, err := pool.Insert(ctx, b.db, "noop", nil, &pool.InsertOpts{UniqueKey: "daily"})
	if err != nil {
		t.Fatal(err)
	}
	b.events.wait(t, 1, 10*time.Second)
	waitFor(t, 10*time.Second, func() bool { return getRow(t, b.db, first).State == "completed" })
	id, err := pool.Insert(ctx, b.db, "noop", nil, &pool.InsertOpts{UniqueKey: "daily", UniqueFinishedWithin: time.Hour})
	if !errors.Is(err, pool.ErrDuplicate) || id != first {
		t.Fatalf("insert within the window: %d, %v; want a duplicate of %d", id, err, first)
	}
	second, err := pool.Insert(ctx, b.db, "noop", nil, &pool.InsertOpts{UniqueKey: "daily"})
	if err != nil || second == first {
		t.Fatalf("insert after completion: %d, %v; want a new job", second, err)
	}
	b.events.wait(t, 1, 10*time.Second)
}

// The output a handler records is written with its completion; an attempt that lost its lease
// writes neither its outcome nor its output; output with CompleteTx commits in the same
// transaction; hostile output is cleaned.
func TestOutputFenced(t *testing.T) {
	t.Parallel()
	cfg := fastConfig()
	cfg.LeaseDuration, cfg.HeartbeatInterval = time.Minute, 20*time.Second
	release := make(chan struct{})
	started := make(chan int64, 4)
	db := pgtest.Pool(t)
	p, b := setup(t, db, cfg, map[string]pool.Handler{
		"out": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			return j.SetOutput(map[string]any{"rows": 3, "note": "a\x00b\xffc"})
		}),
		"stale": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if err := j.SetOutput(map[string]string{"from": "stale holder"}); err != nil {
				return err
			}
			started <- j.ID
			<-release
			return nil
		}),
		"tx": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if err := j.SetOutput([]int{1, 2}); err != nil {
				return err
			}
			return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return j.CompleteTx(ctx, tx) })
		}),
		"big": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if err := j.SetOutput(string(make([]byte, pool.MaxOutputBytes+1))); err == nil {
				return errors.New("oversized output accepted")
			}
			return nil
		}),
	})
	start(t, p)
	output := func(id int64) map[string]any {
		var raw []byte
		if err := b.db.QueryRow(context.Background(), `SELECT output FROM leash.jobs WHERE id = $1`, id).Scan(&raw); err != nil {
			t.Fatal(err)
		}
		if raw == nil {
			return nil
		}
		var v map[string]any
		if err := json.Unmarshal(raw, &v); err != nil {
			var arr []any
			if json.Unmarshal(raw, &arr) == nil {
				return map[string]any{"array": arr}
			}
			t.Fatalf("output %q: %v", raw, err)
		}
		return v
	}
	ok := insert(t, b.db, "out", nil, nil)
	tx := insert(t, b.db, "tx", nil, nil)
	big := insert(t, b.db, "big", nil, nil)
	b.events.wait(t, 3, 10*time.Second)
	if o := output(ok); o["rows"] != float64(3) || o["note"] != "a\uFFFDb\uFFFDc" {
		t.Fatalf("output of a completed job: %v", o)
	}
	if o := output(tx); o == nil || len(o["array"].([]any)) != 2 {
		t.Fatalf("output with CompleteTx: %v", o)
	}
	if r := getRow(t, b.db, big); r.State != "completed" || output(big) != nil {
		t.Fatalf("job with refused output: %s, %v", r.State, output(big))
	}

	stale := insert(t, b.db, "stale", nil, nil)
	<-started
	// Another worker takes the job over (as after an expired lease): the first claim's token no
	// longer holds.
	if _, err := b.db.Exec(context.Background(),
		`UPDATE leash.jobs SET lease_token = nextval('leash.lease_tokens'), leased_by = 'other' WHERE id = $1`, stale); err != nil {
		t.Fatal(err)
	}
	close(release)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, b.db, stale); r.State != "running" || output(stale) != nil {
		t.Fatalf("stale holder wrote: state %s, output %v", r.State, output(stale))
	}
}

// A cancelled or failed job runs again after RetryJob, with its revocation lifted and one more
// attempt; queued, running, finished-successfully and unknown jobs are refused, and a job whose
// unique key another job holds is refused with an error.
func TestRetryJob(t *testing.T) {
	t.Parallel()
	var fail atomic.Bool
	fail.Store(true)
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{
		"noop": noop(),
		"once": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if fail.Load() {
				return pool.Permanent(errors.New("broken"))
			}
			return nil
		}),
	})
	ctx := context.Background()
	cancelled := insert(t, b.db, "noop", nil, &pool.InsertOpts{Delay: time.Hour, UniqueKey: "u"})
	if _, err := b.db.Exec(ctx, `SELECT leash.revoke_job($1, 'mistake')`, cancelled); err != nil {
		t.Fatal(err)
	}
	if r := getRow(t, b.db, cancelled); r.State != "cancelled" || !r.Revoked {
		t.Fatalf("revoked queued job: %+v", r)
	}
	failed := insert(t, b.db, "once", nil, &pool.InsertOpts{MaxAttempts: 1})
	queued := insert(t, b.db, "noop", nil, &pool.InsertOpts{Delay: time.Hour})
	start(t, p)
	b.events.wait(t, 1, 10*time.Second)
	if r := getRow(t, b.db, failed); r.State != "failed" || r.Attempt != 1 {
		t.Fatalf("failing job: %+v", r)
	}
	for _, id := range []int64{queued, 1 << 40} {
		if ok, err := pool.RetryJob(ctx, b.db, id); ok || err != nil {
			t.Fatalf("RetryJob(%d) = %v, %v; want false", id, ok, err)
		}
	}
	// Another job took the cancelled job's unique key meanwhile.
	holder := insert(t, b.db, "noop", nil, &pool.InsertOpts{Delay: time.Hour, UniqueKey: "u"})
	if ok, err := pool.RetryJob(ctx, b.db, cancelled); ok || err == nil {
		t.Fatalf("RetryJob with the key taken = %v, %v; want an error", ok, err)
	}
	if _, err := b.db.Exec(ctx, `DELETE FROM leash.jobs WHERE id = $1`, holder); err != nil {
		t.Fatal(err)
	}
	fail.Store(false)
	for _, id := range []int64{cancelled, failed} {
		if ok, err := pool.RetryJob(ctx, b.db, id); !ok || err != nil {
			t.Fatalf("RetryJob(%d) = %v, %v; want true", id, ok, err)
		}
	}
	b.events.wait(t, 2, 10*time.Second)
	waitFor(t, 10*time.Second, func() bool {
		return getRow(t, b.db, cancelled).State == "completed" && getRow(t, b.db, failed).State == "completed"
	})
	if r := getRow(t, b.db, failed); r.Attempt != 2 || len(r.Errors) != 1 {
		t.Fatalf("retried failed job: attempt %d, errors %v; want attempt 2 with its history", r.Attempt, r.Errors)
	}
	if r := getRow(t, b.db, cancelled); r.Revoked {
		t.Fatal("retried job is still marked revoked")
	}
	if ok, err := pool.RetryJob(ctx, b.db, failed); ok || err != nil {
		t.Fatalf("RetryJob of a completed job = %v, %v; want false", ok, err)
	}
}

// A snoozed job runs again after the delay without using up an attempt, however often it
// snoozes; a revocation still beats a snooze.
func TestSnoozeIsNotAnAttempt(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	var lastEnd atomic.Int64
	gaps := make(chan time.Duration, 10)
	revokedStarted := make(chan struct{})
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{
		"nap": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if e := lastEnd.Load(); e != 0 {
				gaps <- time.Since(time.Unix(0, e))
			}
			defer lastEnd.Store(time.Now().UnixNano())
			if j.Attempt != 1 {
				return pool.Permanent(errors.New("snoozes were counted as attempts"))
			}
			if runs.Add(1) <= 3 {
				return pool.Snooze(150 * time.Millisecond)
			}
			return nil
		}),
		"revoked": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			close(revokedStarted)
			<-ctx.Done()
			return pool.Snooze(time.Millisecond)
		}),
	})
	start(t, p)
	id := insert(t, b.db, "nap", nil, &pool.InsertOpts{MaxAttempts: 1})
	waitFor(t, 10*time.Second, func() bool { return getRow(t, b.db, id).State == "completed" })
	if n := runs.Load(); n != 4 {
		t.Fatalf("handler ran %d times; want 4 (three snoozes, then done)", n)
	}
	if r := getRow(t, b.db, id); r.Attempt != 1 || len(r.Errors) != 0 {
		t.Fatalf("after snoozes: attempt %d, errors %v; want attempt 1 and no errors", r.Attempt, r.Errors)
	}
	for range 3 {
		if g := <-gaps; g < 140*time.Millisecond {
			t.Fatalf("ran again %s after snoozing for 150ms", g)
		}
	}

	rid := insert(t, b.db, "revoked", nil, nil)
	<-revokedStarted
	if _, err := b.db.Exec(context.Background(), `SELECT leash.revoke_job($1)`, rid); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, func() bool { return getRow(t, b.db, rid).State == "cancelled" })
}

// A snooze returned after the attempt's timeout fired does not give the attempt back: the
// attempt fails like any timeout, so a job cannot escape its timeout by snoozing.
func TestSnoozeAfterTimeoutFails(t *testing.T) {
	t.Parallel()
	p, b := setup(t, nil, fastConfig(), map[string]pool.Handler{"slow": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		<-ctx.Done()
		return pool.Snooze(time.Millisecond)
	})})
	start(t, p)
	id := insert(t, b.db, "slow", nil, &pool.InsertOpts{Timeout: 20 * time.Millisecond, MaxAttempts: 2})
	waitFor(t, 20*time.Second, func() bool { return getRow(t, b.db, id).State == "failed" })
	if r := getRow(t, b.db, id); r.Attempt != 2 || len(r.Errors) != 2 {
		t.Fatalf("after two timed-out snoozes: attempt %d, %d errors; want 2 and 2", r.Attempt, len(r.Errors))
	}
}
