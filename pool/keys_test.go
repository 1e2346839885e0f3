package pool_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// keyRuns records, in the handlers, how many jobs of each key run at once (the most seen, over
// all keys) and the order in which each key's jobs started (job ids, a retry or snooze repeating
// its id).
type keyRuns struct {
	mu     sync.Mutex
	now    map[string]int
	most   int
	starts map[string][]int64
	// over, while set, records every start that found more than this many of its key running.
	over     atomic.Int64
	overSeen atomic.Int64
	keyless  concurrency
}

func newKeyRuns() *keyRuns {
	return &keyRuns{now: map[string]int{}, starts: map[string][]int64{}}
}

func (k *keyRuns) enter(key string, id int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.now[key]++
	k.most = max(k.most, k.now[key])
	k.starts[key] = append(k.starts[key], id)
	if o := k.over.Load(); o > 0 && int64(k.now[key]) > o {
		k.overSeen.Add(1)
	}
}

func (k *keyRuns) leave(key string) {
	k.mu.Lock()
	k.now[key]--
	k.mu.Unlock()
}

// mostRunning is the most jobs of one key running at once so far.
func (k *keyRuns) mostRunning() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.most
}

// busiest is the most jobs of one key running right now.
func (k *keyRuns) busiest() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, c := range k.now {
		n = max(n, c)
	}
	return n
}

// keyHandler runs a job for d, counted by k. A job whose payload says so fails its first attempt
// (retried after 5ms) or snoozes once for 5ms: either way it holds its key meanwhile.
func keyHandler(k *keyRuns, d time.Duration) pool.Handler {
	var snoozed sync.Map
	return pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		if j.ConcurrencyKey == "" {
			k.keyless.enter()
			defer k.keyless.leave()
		} else {
			k.enter(j.ConcurrencyKey, j.ID)
			defer k.leave(j.ConcurrencyKey)
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		switch p := string(j.Payload); {
		case strings.Contains(p, `"fail"`) && j.Attempt == 1:
			return pool.RetryAfter(5*time.Millisecond, errors.New("first attempt fails"))
		case strings.Contains(p, `"snooze"`):
			if _, again := snoozed.LoadOrStore(j.ID, true); !again {
				return pool.Snooze(5 * time.Millisecond)
			}
		}
		return nil
	})
}

// sampleKeyRunning records the most jobs of one key of queue seen running at once in the
// database until stop.
func sampleKeyRunning(t *testing.T, db *pgxpool.Pool, queue string, stop <-chan struct{}) *atomic.Int64 {
	t.Helper()
	var most atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			var n int64
			if err := db.QueryRow(context.Background(), `SELECT coalesce(max(n), 0) FROM (
				SELECT concurrency_key, count(*) AS n FROM leash.jobs
				WHERE queue = $1 AND state = 'running' AND concurrency_key IS NOT NULL GROUP BY 1) r`, queue).Scan(&n); err != nil {
				return
			}
			if n > most.Load() {
				most.Store(n)
			}
		}
	}()
	t.Cleanup(wg.Wait)
	return &most
}

// insertKeyed inserts, in one statement, jobs per key for each of keys (in id order within a
// key, all of one run_at and priority), every seventh failing its first attempt and every
// eleventh snoozing once, and keyless jobs without a key.
func insertKeyed(t *testing.T, db *pgxpool.Pool, queue string, keys, perKey, keyless int) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `
		INSERT INTO leash.jobs (queue, kind, concurrency_key, payload)
		SELECT $1, 'kw', k, CASE WHEN (i * 131 + k_n) % 7 = 0 THEN '{"fail": true}'::jsonb
		                         WHEN (i * 131 + k_n) % 11 = 0 THEN '{"snooze": true}'::jsonb ELSE '{}' END
		FROM generate_series(1, $3) i, generate_series(1, $2) k_n, LATERAL (SELECT 'key-' || k_n AS k) kk
		UNION ALL
		SELECT $1, 'kw', NULL, '{}' FROM generate_series(1, $4)
`, queue, keys, perKey, keyless); err != nil {
		t.Fatal(err)
	}
}

// checkKeyOrder fails unless each key's jobs started in id order, a job started again (a retry, a
// snooze) only right after its own earlier start.
func checkKeyOrder(t *testing.T, k *keyRuns) {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	for key, ids := range k.starts {
		for i := 1; i < len(ids); i++ {
			if ids[i] < ids[i-1] {
				t.Fatalf("key %s: jobs started in the order %v: job %d after job %d", key, ids, ids[i], ids[i-1])
			}
		}
	}
}

// A per-key limit holds across four pools that together have far more free slots than one key
// may use: neither the handlers of one key running at once nor its rows running ever exceed it,
// jobs without a key run beside them unlimited, every job completes, and with a limit of 1 each
// key's jobs start in its order, a job that failed or snoozed running again before the next one.
// Also with the isolation level a DBA may set for the database: the claim's count of a key's
// holders is exact only under READ COMMITTED, which it sets for itself.
func TestPerKeyLimitAcrossPools(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		limit int
		iso   string
	}{{2, ""}, {1, ""}, {1, "repeatable read"}} {
		t.Run(fmt.Sprintf("limit_%d_%s", tc.limit, strings.ReplaceAll(cmp.Or(tc.iso, "default"), " ", "_")), func(t *testing.T) {
			t.Parallel()
			db := pgtest.Pool(t)
			if tc.iso != "" {
				db = withDatabaseSetting(t, db, "default_transaction_isolation", tc.iso)
			}
			perKeyLimitAcrossPools(t, db, tc.limit)
		})
	}
}

func perKeyLimitAcrossPools(t *testing.T, db *pgxpool.Pool, limit int) {
	ctx := context.Background()
	const keys, perKey, keyless = 30, 12, 60
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, "keyed", limit); err != nil {
		t.Fatal(err)
	}
	insertKeyed(t, db, "keyed", keys, perKey, keyless)
	k := newKeyRuns()
	stop := make(chan struct{})
	most := sampleKeyRunning(t, db, "keyed", stop)
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"keyed"}
		cfg.Concurrency = 20
		// Each attempt runs 20 ms, so that under a loaded machine too the jobs of a key overlap
		// and the limit is reached (checked below), not only respected.
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"kw": keyHandler(k, 20*time.Millisecond)})
		start(t, p)
	}
	waitFor(t, 60*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == keys*perKey+keyless
	})
	close(stop)
	if m := k.mostRunning(); m > limit {
		t.Fatalf("%d handlers of one key ran at once; the limit is %d", m, limit)
	}
	if m := most.Load(); m > int64(limit) {
		t.Fatalf("%d jobs of one key were running at once in the database; the limit is %d", m, limit)
	}
	if k.mostRunning() < limit {
		t.Fatalf("at most %d handlers of one key ran at once: the limit %d was never reached", k.mostRunning(), limit)
	}
	if k.keyless.max.Load() < 2 {
		t.Fatalf("at most %d job without a key ran at once: they were limited", k.keyless.max.Load())
	}
	if limit == 1 {
		checkKeyOrder(t, k)
	}
	// The last outcomes' wakes are consumed by the next claims (the poll's).
	waitFor(t, 5*time.Second, func() bool {
		return count(t, db, `SELECT (SELECT count(*) FROM leash.concurrency_keys) + (SELECT count(*) FROM leash.key_wakes)`) == 0
	})
}

// A per-key limit set, lowered, raised and removed under load binds every worker from its
// commit: once the jobs over a lowered limit that were running then have finished, no start finds
// more of its key running than the limit; a raised limit is used at once; without a limit the
// queue drains as any other. The limit is first set on a queue the pools already work unlimited,
// so their claims go by a view of leash.queues that does not know it yet.
func TestPerKeyLimitChangedUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	const keys, perKey = 8, 400
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key)
		SELECT 'lq', 'kw', 'key-' || k FROM generate_series(1, $2) i, generate_series(1, $1) k`, keys, perKey); err != nil {
		t.Fatal(err)
	}
	k := newKeyRuns()
	for range 4 {
		cfg := fastConfig()
		cfg.Queues = []string{"lq"}
		cfg.Concurrency = 8
		// The view of leash.queues lags behind (no notifications, a poll a second): the claims
		// must not.
		cfg.PollInterval = time.Second
		deafListener(t, &cfg)
		p, _ := setup(t, db, cfg, map[string]pool.Handler{"kw": keyHandler(k, 60*time.Millisecond)})
		start(t, p)
	}
	waitFor(t, 10*time.Second, func() bool { return k.busiest() >= 3 })
	settle := func(limit int) {
		t.Helper()
		if limit < 0 {
			if err := pool.SetQueueMaxRunningPerKey(ctx, db, "lq", limit); err != nil {
				t.Fatal(err)
			}
			return
		}
		// The jobs over the new limit that were running at its commit finish within a few ms: in
		// the database, whose running rows include those claimed and not yet started.
		waitFor(t, 10*time.Second, func() bool {
			return count(t, db, `SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM leash.jobs
				WHERE queue = 'lq' AND state = 'running' GROUP BY concurrency_key) r`) <= int64(limit)
		})
		k.over.Store(int64(limit))
	}
	// Jobs claimed from the commit of each change until the next, per change, as (from, to).
	type window struct{ from, to time.Time }
	var windows []window
	now := func() time.Time {
		var ts time.Time
		if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&ts); err != nil {
			t.Fatal(err)
		}
		return ts
	}
	limits := []int{1, 3, 2, 1}
	for i, limit := range limits {
		if i > 0 {
			windows[i-1].to = now()
		}
		k.over.Store(0) // a raised limit is seen only from its commit
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, "lq", limit); err != nil {
			t.Fatal(err)
		}
		windows = append(windows, window{from: now()})
		settle(limit)
		before := count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`)
		waitFor(t, 20*time.Second, func() bool {
			return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) >= before+100
		})
		if limit > 1 {
			waitFor(t, 10*time.Second, func() bool { return k.busiest() == limit })
		}
		if n := k.overSeen.Load(); n > 0 {
			t.Fatalf("limit %d: %d starts found more of their key running", limit, n)
		}
	}
	windows[len(windows)-1].to = now()
	settle(-1)
	waitFor(t, 30*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == keys*perKey
	})
	// In the database: among the jobs claimed under one limit (from its commit on), never more of
	// one key ran at once than that limit. A job's claim (attempted_at) comes after the outcome
	// of the one it waited for (finished_at, that outcome's transaction time), give or take the
	// time between the start of the claim's transaction (its now(), before it takes the queue's
	// row) and the snapshot of its claim statement: a few hundred microseconds, tens of
	// milliseconds on a loaded machine whose backend is descheduled in between. 30ms, half of what
	// a job runs: a job started beside a running one of its key overlaps it by up to 60ms.
	for i, w := range windows {
		if n := count(t, db, `
			SELECT coalesce(max(n), 0) FROM (
				SELECT a.id, count(*) AS n FROM leash.jobs a JOIN leash.jobs b
				  ON b.queue = a.queue AND b.concurrency_key = a.concurrency_key
				 AND b.attempted_at <= a.attempted_at AND b.finished_at > a.attempted_at + interval '30 milliseconds'
				WHERE a.queue = 'lq' AND a.attempted_at >= $1 AND a.attempted_at < $2
				  AND b.attempted_at >= $1 AND b.attempted_at < $2
				GROUP BY a.id) o`, w.from, w.to); n > int64(limits[i]) {
			t.Fatalf("limit %d: a job started while %d of its key claimed under that limit ran", limits[i], n)
		}
	}
}

// A job holds its key through every way an attempt can end without finishing the job, and the
// key is released once the job is finished: a job whose worker died (its lease expired: rescued,
// then run again) runs again before its key's next job; a revoked job (cancelled) lets the next
// one start; a job handed back at shutdown runs again, on another pool, before its key's next
// job; a job past its timeout is retried before the next one. No key ever has two jobs running.
func TestKeyHeldUntilFinished(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, "rq", 1); err != nil {
		t.Fatal(err)
	}
	ids := map[string][2]int64{}
	for _, key := range []string{"rescue", "revoke", "handback", "timeout"} {
		var pair [2]int64
		for i := range pair {
			opts := &pool.InsertOpts{Queue: "rq", ConcurrencyKey: key}
			payload := map[string]bool{"block": i == 0 && key != "rescue"}
			if key == "timeout" && i == 0 {
				opts.Timeout = 100 * time.Millisecond
			}
			id, err := pool.Insert(ctx, db, "kb", payload, opts)
			if err != nil {
				t.Fatal(err)
			}
			pair[i] = id
		}
		ids[key] = pair
	}
	// The first job of key rescue is held by a worker that died: running, its lease expired.
	if _, err := db.Exec(ctx, `UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(),
		lease_token = nextval('leash.lease_tokens'), leased_by = 'dead', lease_expires_at = now() - interval '1 second'
		WHERE id = $1`, ids["rescue"][0]); err != nil {
		t.Fatal(err)
	}
	k := newKeyRuns()
	var blocked sync.Map // job ids whose first attempt blocked
	started := make(chan int64, 16)
	handler := pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		k.enter(j.ConcurrencyKey, j.ID)
		defer k.leave(j.ConcurrencyKey)
		var p struct{ Block bool }
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return err
		}
		if _, again := blocked.LoadOrStore(j.ID, true); !again && p.Block {
			started <- j.ID
			<-ctx.Done()
			return context.Cause(ctx)
		}
		return nil
	})
	cfg := fastConfig()
	cfg.Queues = []string{"rq"}
	cfg.RescueInterval = 100 * time.Millisecond
	cfg.ShutdownTimeout = 50 * time.Millisecond
	first, _ := setup(t, db, cfg, map[string]pool.Handler{"kb": handler})
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	waiting := map[int64]bool{ids["revoke"][0]: true, ids["handback"][0]: true, ids["timeout"][0]: true}
	for len(waiting) > 0 {
		select {
		case id := <-started:
			delete(waiting, id)
		case <-time.After(10 * time.Second):
			t.Fatalf("jobs %v never started", waiting)
		}
	}
	if ok, err := pool.RevokeJob(ctx, db, ids["revoke"][0], "test"); err != nil || !ok {
		t.Fatalf("RevokeJob = %v, %v", ok, err)
	}
	state := func(id int64) string {
		var s string
		if err := db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, key := range []string{"rescue", "revoke", "timeout"} {
		waitFor(t, 10*time.Second, func() bool { return state(ids[key][1]) == "completed" })
	}
	if s := state(ids["handback"][1]); s != "available" {
		t.Fatalf("the job after the one running on the first pool is %s; want available (its key is held)", s)
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	first.Shutdown(sctx)
	if err := <-done; err != nil && !errors.Is(err, pool.ErrJobsCancelled) {
		t.Fatalf("Run: %v", err)
	}
	if s := state(ids["handback"][0]); s != "available" {
		t.Fatalf("the job running at shutdown is %s; want available (handed back)", s)
	}
	second, _ := setup(t, db, cfg, map[string]pool.Handler{"kb": handler})
	start(t, second)
	waitFor(t, 10*time.Second, func() bool { return state(ids["handback"][1]) == "completed" })
	if m := k.mostRunning(); m > 1 {
		t.Fatalf("%d jobs of one key ran at once; the limit is 1", m)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for key, want := range map[string][]int64{
		"rescue":   {ids["rescue"][0], ids["rescue"][1]},
		"revoke":   {ids["revoke"][0], ids["revoke"][1]},
		"handback": {ids["handback"][0], ids["handback"][0], ids["handback"][1]},
		"timeout":  {ids["timeout"][0], ids["timeout"][0], ids["timeout"][1]},
	} {
		if got := k.starts[key]; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("key %s: jobs started in the order %v; want %v", key, got, want)
		}
	}
}

// The Go API's concurrency keys: empty is no key (NULL), NUL bytes, invalid UTF-8 and keys over
// MaxConcurrencyKeyBytes are refused before the database, a key of exactly that length is kept.
func TestConcurrencyKeyChecked(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	for _, bad := range []string{"a\x00b", "bad\xff", strings.Repeat("k", pool.MaxConcurrencyKeyBytes+1)} {
		if _, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{ConcurrencyKey: bad}); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("key %q: %v; want ErrInvalidJob", bad[:min(len(bad), 8)], err)
		}
		if _, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{{Kind: "k", Opts: &pool.InsertOpts{ConcurrencyKey: bad}}}); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("InsertMany, key %q: %v; want ErrInvalidJob", bad[:min(len(bad), 8)], err)
		}
	}
	long := strings.Repeat("é", pool.MaxConcurrencyKeyBytes/2)
	for _, key := range []string{"", "tenant-1", long} {
		id, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{ConcurrencyKey: key})
		if err != nil {
			t.Fatal(err)
		}
		uid, err := pool.Insert(ctx, db, "k", nil, &pool.InsertOpts{ConcurrencyKey: key, UniqueKey: "u" + fmt.Sprint(id)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{{Kind: "k", Opts: &pool.InsertOpts{ConcurrencyKey: key}},
			{Kind: "k", Opts: &pool.InsertOpts{ConcurrencyKey: key, Delay: time.Hour}}}); err != nil {
			t.Fatal(err)
		}
		want := any(key)
		if key == "" {
			want = nil
		}
		n := count(t, db, `SELECT count(*) FROM leash.jobs WHERE concurrency_key IS NOT DISTINCT FROM $1 AND id >= $2`, want, id)
		if n != 4 || uid <= id {
			t.Fatalf("key %q: %d jobs stored with it; want 4", key[:min(len(key), 8)], n)
		}
	}
}

// A job without a key in a queue with a per-key limit whose backlog is all keyed starts at once:
// its insert tells the next claim to look for such jobs, which claims otherwise do only every ten
// poll intervals (here twenty seconds).
func TestUnkeyedJobStartsBesideKeyedBacklog(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, "uq", 1); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (queue, kind, concurrency_key)
		SELECT 'uq', 'block', 'busy' FROM generate_series(1, 50)`); err != nil {
		t.Fatal(err)
	}
	blocking := make(chan struct{})
	cfg := fastConfig()
	cfg.Queues = []string{"uq"}
	cfg.PollInterval = 2 * time.Second
	cfg.ShutdownTimeout = 50 * time.Millisecond
	p, _ := setup(t, db, cfg, map[string]pool.Handler{
		"block": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			select {
			case blocking <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return context.Cause(ctx)
		}),
		"free": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error { return nil }),
	})
	start(t, p)
	select {
	case <-blocking:
	case <-time.After(10 * time.Second):
		t.Fatal("the first keyed job never started")
	}
	// Past the first claims, which look for jobs without a key by themselves.
	time.Sleep(300 * time.Millisecond)
	id, err := pool.Insert(ctx, db, "free", nil, &pool.InsertOpts{Queue: "uq"})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE id = $1 AND state = 'completed'`, id) == 1
	})
}

// Roles holding exactly docs/sql.md's grants work per-key limits: an operator sets the limit, an
// inserter inserts jobs with and without a key (the triggers need no right of theirs), and a
// worker claims them.
func TestPerKeyLimitWithDocsGrants(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	ctx := context.Background()
	operator := poolAsRole(t, db, readmeGrants(t, "leash_operator", "%s")...)
	if _, err := operator.Exec(ctx, `SELECT leash.set_queue_max_running_per_key('gq', 1)`); err != nil {
		t.Fatal(err)
	}
	inserter := poolAsRole(t, db, readmeGrants(t, "leash_inserter", "%s")...)
	for _, key := range []string{"a", "a", "b", ""} {
		if _, err := pool.Insert(ctx, inserter, "kw", nil, &pool.InsertOpts{Queue: "gq", ConcurrencyKey: key}); err != nil {
			t.Fatal(err)
		}
	}
	worker := poolAsRole(t, db, readmeGrants(t, "leash_worker", "%s")...)
	k := newKeyRuns()
	cfg := fastConfig()
	cfg.Queues = []string{"gq"}
	p, _ := setup(t, worker, cfg, map[string]pool.Handler{"kw": keyHandler(k, time.Millisecond)})
	start(t, p)
	waitFor(t, 10*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 4
	})
	if m := k.mostRunning(); m > 1 {
		t.Fatalf("%d jobs of one key ran at once; the limit is 1", m)
	}
	// A per-key rate limit, set by the operator, and the worker's retention of its starts.
	if _, err := operator.Exec(ctx, `SELECT leash.set_queue_key_rate_limit('gq', 1, interval '50 milliseconds')`); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"a", "a", "b"} {
		if _, err := pool.Insert(ctx, inserter, "kw", nil, &pool.InsertOpts{Queue: "gq", ConcurrencyKey: key}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, func() bool {
		return count(t, db, `SELECT count(*) FROM leash.jobs WHERE state = 'completed'`) == 7
	})
	// Retention keeps starts a minute past their window: these are made older by hand.
	if n := count(t, db, `SELECT count(*) FROM leash.key_rates`); n != 2 {
		t.Fatalf("%d rows of leash.key_rates; want keys a and b", n)
	}
	if _, err := db.Exec(ctx, `UPDATE leash.key_rates SET starts = ARRAY[now() - interval '2 minutes']`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.PruneOnce(ctx); err != nil {
		t.Fatalf("retention as the worker's role: %v", err)
	}
	if n := count(t, db, `SELECT count(*) FROM leash.key_rates`); n != 0 {
		t.Fatalf("%d rows of leash.key_rates left after retention; want none", n)
	}
}
