package pool_test

// A model-based randomized test of flow control: per-key limits, sequential keys and rate limits.
//
// Each seed draws four or five queues (one sequential: a per-key limit of 1 that never changes;
// one whose per-key limit is changed under load, removed and set again; one rate-limited, small
// limits of 20 to 50 starts per 200ms; one with a per-key rate limit of 2 to 5 starts per 150ms,
// changed under load, sometimes with a per-key limit or a rate limit beside it; sometimes an
// unlimited one) and drives three or four real
// pools sharing one fresh database through inserts of jobs with few keys, many keys or none
// (single and InsertMany, some of higher priority, some scheduled), scripted handler endings
// (success, an error retried, a snooze, a permanent failure), forced lease expiry (rescued by a
// pool), revocations, pool restarts and limit changes. Then the pools drain everything.
//
// Checked: (a) as each attempt starts, in the handler, a key of a queue never has more holders
// (jobs running, or started once and waiting to run again, docs/queues.md) than its per-key
// limit, read from the database and counted in memory (the handlers live of each key: a subset
// of its holders); after a lowered limit, the older bound holds until the database shows the
// key under the new one; (b) a sequential key's jobs start in (priority, run_at, id) order: at a
// job's first start no job of its key that is due, committed well before and earlier in that
// order waits unstarted, and a job's attempts are never interleaved with another job of its key;
// (c) in any window of the period that begins after the last change of the rate limit (and
// ends before the next change began), a rate-limited queue's starts, read from attempted_at in
// the database and recorded by the handlers, never exceed the limit; (e) the same for each key of
// the queue with a per-key rate limit, under its limit and period; (d) everything drains:
// nothing is left queued that a pool could claim, no key stays stuck.
//
//	LEASH_MODEL_SEED=<n>  run only that seed

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// TestModelFlow runs three seeds (LEASH_MODEL_SEED: one given seed).
func TestModelFlow(t *testing.T) {
	t.Parallel()
	seeds := []int64{time.Now().UnixNano() % 1e9, 1, 2}
	if s := os.Getenv("LEASH_MODEL_SEED"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		seeds = []int64{n}
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			runFlowModel(t, seed, 4*time.Second)
		})
	}
}

// unbounded: no per-key limit binds.
const unbounded = math.MaxInt

// flowQueue is a queue of the model and what its limits are.
type flowQueue struct {
	name  string
	seq   bool // a per-key limit of 1 that never changes
	keys  int  // how many keys its jobs draw from
	empty int  // percent of its jobs without a key
	// Guarded by the model's mutex.
	perKey int // the per-key limit now: unbounded when none
	// bound: the most holders a key may have now. A lowered (or newly set) limit binds the
	// jobs claimed from its commit; those holding their key then go on, so bound stays at the
	// old value until the database shows every key under the new limit (settle).
	bound   int
	settled bool
	rated   bool
	period  time.Duration
	segs    []rateSeg
	// The per-key rate limit, as rated, period and segs are the queue's.
	keyRated  bool
	keyPeriod time.Duration
	keySegs   []rateSeg
}

// rateSeg is a rate limit from the commit of its change (from) until the next change began.
type rateSeg struct {
	from, until time.Time
	limit       int
}

// flowScript is what a job's handler does, attempt by attempt: "ok", "retry" (an error),
// "snooze", "perm" (a permanent failure); past its end it succeeds (run by run of the handler:
// a snooze costs no attempt). Hold: how long it works.
type flowScript struct {
	Steps []string `json:"steps"`
	Hold  int      `json:"hold_ms"`
}

// flowLive is a handler running: its job, its lease's token and its context.
type flowLive struct {
	token int64
	ctx   context.Context
}

// flowBatch is an insert of the driver: the last id it inserted, and the database's clock once it
// had committed.
type flowBatch struct {
	last int64
	at   time.Time
}

// flowStart is a start of a job: its id and attempted_at (microseconds).
type flowStart struct {
	id int64
	at int64
}

type flowModel struct {
	t    *testing.T
	seed int64
	rng  *rand.Rand
	url  string
	db   *pgxpool.Pool // the driver's and the handlers' checks
	qs   map[string]*flowQueue
	// names: the queues in a fixed order, for the seeded draws.
	names []string

	pools []*pool.Pool
	dbs   []*pgxpool.Pool
	stops []chan error
	// started counts the pools started, for their ids.
	started int

	mu         sync.Mutex
	violations []string
	live       map[[2]string]map[int64]flowLive // (queue, key) -> job -> its running handler
	expired    map[int64]bool                   // tokens whose lease the driver made expire
	runs       map[int64]int                    // how many times each job's handler started
	order      map[[2]string][]int64            // a sequential key's starts, job ids
	starts     map[string]map[flowStart]bool    // a rated queue's starts seen by handlers
	keyStarts  map[[2]string]map[flowStart]bool // a key-rated queue's starts by key, seen by handlers
	ops        map[string]int
	batches    []flowBatch // the driver's inserts, in order
	atLimit    int         // starts that found their key at its limit: the limits bind
	jobs       int
}

func (m *flowModel) violate(format string, args ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.violations) < 50 {
		m.violations = append(m.violations, fmt.Sprintf(format, args...))
	}
}

// dbNow is the database clock.
func (m *flowModel) dbNow(ctx context.Context) time.Time {
	var now time.Time
	if err := m.db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		m.t.Fatalf("seed %d: clock: %v", m.seed, err)
	}
	return now
}

// setPerKey sets queue q's per-key limit (unbounded: none). A raised bound applies before the
// change commits, a lowered one once settle sees it hold.
func (m *flowModel) setPerKey(ctx context.Context, q *flowQueue, n int) {
	m.mu.Lock()
	if n > q.bound {
		q.bound = n
	}
	q.perKey, q.settled = n, n >= q.bound
	m.mu.Unlock()
	arg := n
	if n == unbounded {
		arg = -1
	}
	if err := pool.SetQueueMaxRunningPerKey(ctx, m.db, q.name, arg); err != nil {
		m.t.Fatalf("seed %d: set the per-key limit of %s: %v", m.seed, q.name, err)
	}
	m.ops["per-key limit"]++
}

// settle lowers the bound of each queue whose lowered limit the database now shows held.
func (m *flowModel) settle(ctx context.Context) {
	for _, name := range m.names {
		q := m.qs[name]
		m.mu.Lock()
		settled, limit := q.settled, q.perKey
		m.mu.Unlock()
		if settled {
			continue
		}
		var most int
		if err := m.db.QueryRow(ctx, `SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM leash.jobs
			WHERE queue = $1 AND concurrency_key IS NOT NULL
			  AND (state = 'running' OR (state IN ('available', 'retryable') AND attempted_at IS NOT NULL))
			GROUP BY concurrency_key) h`, name).Scan(&most); err != nil {
			m.t.Fatalf("seed %d: %v", m.seed, err)
		}
		m.mu.Lock()
		if q.perKey == limit && most <= limit {
			q.bound, q.settled = limit, true
		}
		m.mu.Unlock()
	}
}

// setRate sets queue q's rate limit to n per its period, recording when the change began and
// committed.
func (m *flowModel) setRate(ctx context.Context, q *flowQueue, n int) {
	began := m.dbNow(ctx)
	if err := pool.SetQueueRateLimit(ctx, m.db, q.name, n, q.period); err != nil {
		m.t.Fatalf("seed %d: set the rate limit of %s: %v", m.seed, q.name, err)
	}
	done := m.dbNow(ctx)
	m.mu.Lock()
	if len(q.segs) > 0 {
		q.segs[len(q.segs)-1].until = began
	}
	q.segs = append(q.segs, rateSeg{from: done, until: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC), limit: n})
	m.mu.Unlock()
	m.ops["rate limit"]++
}

// setKeyRate sets queue q's per-key rate limit to n per its key period, recording when the
// change began and committed.
func (m *flowModel) setKeyRate(ctx context.Context, q *flowQueue, n int) {
	began := m.dbNow(ctx)
	if err := pool.SetQueueKeyRateLimit(ctx, m.db, q.name, n, q.keyPeriod); err != nil {
		m.t.Fatalf("seed %d: set the per-key rate limit of %s: %v", m.seed, q.name, err)
	}
	done := m.dbNow(ctx)
	m.mu.Lock()
	if len(q.keySegs) > 0 {
		q.keySegs[len(q.keySegs)-1].until = began
	}
	q.keySegs = append(q.keySegs, rateSeg{from: done, until: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC), limit: n})
	m.mu.Unlock()
	m.ops["key rate limit"]++
}

// handle checks the key's holders as the attempt starts, then plays the job's script.
func (m *flowModel) handle(ctx context.Context, j *pool.Job) error {
	q := m.qs[j.Queue]
	key := [2]string{j.Queue, j.ConcurrencyKey}
	m.mu.Lock()
	first := m.runs[j.ID] == 0
	m.runs[j.ID]++
	run := m.runs[j.ID]
	if q.rated {
		m.starts[j.Queue][flowStart{j.ID, j.AttemptedAt.UnixMicro()}] = true
	}
	if q.keyRated && j.ConcurrencyKey != "" {
		if m.keyStarts[key] == nil {
			m.keyStarts[key] = map[flowStart]bool{}
		}
		m.keyStarts[key][flowStart{j.ID, j.AttemptedAt.UnixMicro()}] = true
	}
	bound := q.bound
	if j.ConcurrencyKey != "" {
		live := 1
		for id, l := range m.live[key] {
			if id != j.ID && l.ctx.Err() == nil && !m.expired[l.token] {
				live++
			}
		}
		if live > bound {
			m.violations = append(m.violations, fmt.Sprintf("job %d (%s/%s, attempt %d) started beside %d live handlers of its key; at most %d may hold it",
				j.ID, j.Queue, j.ConcurrencyKey, j.Attempt, live-1, bound))
		}
		if m.live[key] == nil {
			m.live[key] = map[int64]flowLive{}
		}
		m.live[key][j.ID] = flowLive{token: j.Token, ctx: ctx}
		if q.seq {
			m.order[key] = append(m.order[key], j.ID)
		}
	}
	m.mu.Unlock()
	if j.ConcurrencyKey != "" {
		defer func() {
			m.mu.Lock()
			if l, ok := m.live[key][j.ID]; ok && l.token == j.Token {
				delete(m.live[key], j.ID)
			}
			m.mu.Unlock()
		}()
		m.checkHolders(ctx, j, bound, first)
	}
	var s flowScript
	if err := json.Unmarshal(j.Payload, &s); err != nil {
		return pool.Permanent(err)
	}
	if err := pool.Sleep(ctx, time.Duration(s.Hold)*time.Millisecond); err != nil {
		return err
	}
	// By the handler's runs, not the attempt: a snooze does not cost one.
	act := "ok"
	if run-1 < len(s.Steps) {
		act = s.Steps[run-1]
	}
	switch act {
	case "retry":
		return fmt.Errorf("scripted failure")
	case "snooze":
		return pool.Snooze(time.Duration(5+j.ID%20) * time.Millisecond)
	case "perm":
		return pool.Permanent(fmt.Errorf("scripted permanent failure"))
	}
	return nil
}

// checkHolders reads the key's holders in the database as job j's attempt starts (invariant a)
// and, at the first start of a job of a sequential key, the jobs that should have started before
// it (invariant b).
func (m *flowModel) checkHolders(ctx context.Context, j *pool.Job, bound int, first bool) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var holders int
	var ids []int64
	if err := m.db.QueryRow(cctx, `SELECT count(*) FROM leash.jobs WHERE queue = $1 AND concurrency_key = $2
		AND (state = 'running' OR (state IN ('available', 'retryable') AND attempted_at IS NOT NULL))`,
		j.Queue, j.ConcurrencyKey).Scan(&holders); err != nil {
		m.violate("job %d: reading its key's holders: %v", j.ID, err)
		return
	}
	q := m.qs[j.Queue]
	m.mu.Lock()
	bound = max(bound, q.bound)
	m.mu.Unlock()
	if holders == bound {
		m.mu.Lock()
		m.atLimit++
		m.mu.Unlock()
	}
	if holders > bound {
		m.violate("job %d (%s/%s, attempt %d) started while its key had %d holders in the database; at most %d may hold it",
			j.ID, j.Queue, j.ConcurrencyKey, j.Attempt, holders, bound)
	}
	if !q.seq || !first || j.Attempt != 1 {
		return
	}
	// Jobs of the key before j in its order, due when j was claimed, never started; j's place as
	// claimed (its row may have changed since: a lease taken away and rescued).
	if err := m.db.QueryRow(cctx, `SELECT coalesce(array_agg(k.id ORDER BY k.id), '{}') FROM leash.jobs j
		JOIN leash.jobs k ON k.queue = j.queue AND k.concurrency_key = j.concurrency_key AND k.id <> j.id
		WHERE j.id = $1 AND k.attempted_at IS NULL AND k.state IN ('available', 'retryable') AND k.revoked_at IS NULL
		  AND k.run_at <= $2 AND (k.priority, k.run_at, k.id) < ($3::smallint, $4::timestamptz, j.id)`,
		j.ID, j.AttemptedAt, j.Priority, j.RunAt).Scan(&ids); err != nil {
		m.violate("job %d: reading its key's earlier jobs: %v", j.ID, err)
		return
	}
	// Only those committed before j's claim began (its attempted_at): an insert in flight as the
	// claim ran is not seen by it.
	m.mu.Lock()
	ids = slices.DeleteFunc(ids, func(id int64) bool {
		i, _ := slices.BinarySearchFunc(m.batches, id, func(b flowBatch, id int64) int { return cmp.Compare(b.last, id) })
		return i == len(m.batches) || !m.batches[i].at.Before(j.AttemptedAt)
	})
	m.mu.Unlock()
	if len(ids) > 0 {
		var rows []string
		if err := m.db.QueryRow(cctx, `SELECT coalesce(array_agg(format('%s: priority %s run_at %s created_at %s attempted_at %s state %s attempt %s',
			id, priority, run_at, created_at, attempted_at, state, attempt) ORDER BY id), '{}') FROM leash.jobs WHERE id = ANY ($1)`,
			append([]int64{j.ID}, ids...)).Scan(&rows); err != nil {
			rows = []string{err.Error()}
		}
		m.violate("job %d (%s/%s, priority %d, run_at %s, attempted_at %s) started first while jobs %v of its sequential key, earlier in (priority, run_at, id), waited: %q",
			j.ID, j.Queue, j.ConcurrencyKey, j.Priority, j.RunAt.Format(time.RFC3339Nano), j.AttemptedAt.Format(time.RFC3339Nano), ids, rows)
	}
}

func (m *flowModel) startPool() {
	db := pgtest.PoolFor(m.t, m.url)
	m.started++
	cfg := pool.Config{ID: fmt.Sprintf("flow-%d-%d", m.seed, m.started), Queues: m.names, Concurrency: 3 + m.rng.IntN(4),
		LeaseDuration: time.Second, HeartbeatInterval: 200 * time.Millisecond, PollInterval: 100 * time.Millisecond,
		RescueInterval: 150 * time.Millisecond, ShutdownTimeout: 200 * time.Millisecond,
		RetryBackoff: func(int) time.Duration { return 15 * time.Millisecond }}
	if os.Getenv("LEASH_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	p, err := pool.New(db, cfg)
	if err != nil {
		m.t.Fatal(err)
	}
	if err := p.Register("flow", pool.HandlerFunc(m.handle)); err != nil {
		m.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	m.pools, m.dbs, m.stops = append(m.pools, p), append(m.dbs, db), append(m.stops, done)
}

func (m *flowModel) stopPool(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m.pools[i].Shutdown(ctx)
	if err := <-m.stops[i]; err != nil && !errors.Is(err, pool.ErrJobsCancelled) {
		m.violate("Run: %v", err)
	}
	m.dbs[i].Close()
	m.pools = slices.Delete(m.pools, i, i+1)
	m.dbs = slices.Delete(m.dbs, i, i+1)
	m.stops = slices.Delete(m.stops, i, i+1)
}

// newFlowModel draws the seed's queues and sets their limits.
func newFlowModel(t *testing.T, seed int64) *flowModel {
	url := pgtest.URL(t)
	m := &flowModel{t: t, seed: seed, rng: rand.New(rand.NewPCG(uint64(seed), 25)), url: url, db: pgtest.PoolFor(t, url),
		qs: map[string]*flowQueue{}, live: map[[2]string]map[int64]flowLive{}, expired: map[int64]bool{},
		runs: map[int64]int{}, order: map[[2]string][]int64{}, starts: map[string]map[flowStart]bool{}, ops: map[string]int{},
		keyStarts: map[[2]string]map[flowStart]bool{}}
	ctx := context.Background()
	add := func(name string, perKey int, rate bool, keys int) *flowQueue {
		q := &flowQueue{name: name, seq: perKey == 1 && name == "seq", keys: keys, empty: m.rng.IntN(30),
			perKey: unbounded, bound: unbounded, settled: true, rated: rate, period: 200 * time.Millisecond,
			keyPeriod: 150 * time.Millisecond}
		m.qs[name] = q
		m.names = append(m.names, name)
		if perKey != unbounded {
			m.setPerKey(ctx, q, perKey)
		}
		if rate {
			m.starts[name] = map[flowStart]bool{}
			m.setRate(ctx, q, 20+m.rng.IntN(31))
		}
		return q
	}
	few := func() int { return []int{2, 3, 40}[m.rng.IntN(3)] }
	add("seq", 1, m.rng.IntN(3) == 0, few())
	add("keyed", 1+m.rng.IntN(3), m.rng.IntN(3) == 0, few())
	rk := unbounded
	if m.rng.IntN(2) == 0 {
		rk = 1 + m.rng.IntN(3)
	}
	add("rated", rk, true, few())
	kr := unbounded
	if m.rng.IntN(3) == 0 {
		kr = 1 + m.rng.IntN(3)
	}
	q := add("krate", kr, m.rng.IntN(4) == 0, few())
	q.keyRated = true
	m.setKeyRate(ctx, q, 2+m.rng.IntN(4))
	if m.rng.IntN(2) == 0 {
		add("free", unbounded, false, few())
	}
	m.settle(ctx)
	return m
}

// insert adds one to six jobs to a queue, one by one or with InsertMany; a burst, 30 to 90 with
// InsertMany, so that the limits bind.
func (m *flowModel) insert(ctx context.Context, burst bool) {
	q := m.qs[m.names[m.rng.IntN(len(m.names))]]
	n := 1 + m.rng.IntN(6)
	if burst {
		n = 30 + m.rng.IntN(61)
		switch m.rng.IntN(3) {
		case 0:
			q = m.qs["rated"]
		case 1:
			q = m.qs["krate"]
		}
	}
	batch := make([]pool.InsertManyParams, n)
	for i := range batch {
		s := flowScript{Hold: m.rng.IntN(25)}
		for range m.rng.IntN(3) {
			s.Steps = append(s.Steps, []string{"retry", "retry", "snooze", "snooze", "perm", "ok"}[m.rng.IntN(6)])
		}
		opts := &pool.InsertOpts{Queue: q.name, MaxAttempts: 5}
		if m.rng.IntN(100) >= q.empty {
			opts.ConcurrencyKey = fmt.Sprintf("k%d", m.rng.IntN(q.keys))
		}
		if m.rng.IntN(4) == 0 {
			opts.Priority = int16(m.rng.IntN(3) - 1)
		}
		if m.rng.IntN(6) == 0 {
			opts.Delay = time.Duration(10+m.rng.IntN(150)) * time.Millisecond
		}
		batch[i] = pool.InsertManyParams{Kind: "flow", Payload: s, Opts: opts}
	}
	if burst || m.rng.IntN(2) == 0 {
		if _, err := pool.InsertMany(ctx, m.db, batch); err != nil {
			m.t.Fatalf("seed %d: InsertMany: %v", m.seed, err)
		}
	} else {
		for _, b := range batch {
			if _, err := pool.Insert(ctx, m.db, b.Kind, b.Payload, b.Opts); err != nil {
				m.t.Fatalf("seed %d: Insert: %v", m.seed, err)
			}
		}
	}
	var last int64
	var at time.Time
	if err := m.db.QueryRow(ctx, `SELECT max(id), clock_timestamp() FROM leash.jobs`).Scan(&last, &at); err != nil {
		m.t.Fatalf("seed %d: %v", m.seed, err)
	}
	m.mu.Lock()
	m.batches = append(m.batches, flowBatch{last: last, at: at})
	m.mu.Unlock()
	m.jobs += n
	m.ops["insert"]++
}

func (m *flowModel) step(ctx context.Context) {
	switch r := m.rng.IntN(48); {
	case r < 13 || r >= 25:
		m.insert(ctx, false)
	case r < 15:
		m.insert(ctx, true)
	case r < 17:
		// A lease taken away: a rescuer takes the job back. Its handler may run on a moment (it
		// hears of the takeover on a notification): it is no longer counted as the key's.
		var id, tok int64
		if m.db.QueryRow(ctx, `SELECT id, lease_token FROM leash.jobs WHERE state = 'running' ORDER BY random() LIMIT 1`).Scan(&id, &tok) == nil {
			m.mu.Lock()
			m.expired[tok] = true
			m.mu.Unlock()
			if _, err := m.db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'
				WHERE id = $1 AND lease_token = $2 AND state = 'running'`, id, tok); err != nil {
				m.t.Fatalf("seed %d: %v", m.seed, err)
			}
			m.ops["expiry"]++
		}
	case r < 19:
		var id int64
		if m.db.QueryRow(ctx, `SELECT id FROM leash.jobs WHERE state IN ('available', 'retryable', 'running')
			ORDER BY random() LIMIT 1`).Scan(&id) == nil {
			if _, err := pool.RevokeJob(ctx, m.db, id, "model"); err != nil {
				m.t.Fatalf("seed %d: revoke: %v", m.seed, err)
			}
			m.ops["revoke"]++
		}
	case r < 20:
		if len(m.pools) > 1 {
			m.stopPool(m.rng.IntN(len(m.pools)))
			m.startPool()
			m.ops["restart"]++
		}
	case r < 23:
		// The per-key limit of a queue other than the sequential one: lowered, raised, removed
		// and set again.
		q := m.qs["keyed"]
		if m.rng.IntN(2) == 0 && m.qs["rated"].perKey != unbounded {
			q = m.qs["rated"]
		}
		n := 1 + m.rng.IntN(3)
		if m.rng.IntN(5) == 0 {
			n = unbounded
		}
		m.setPerKey(ctx, q, n)
	default:
		for _, name := range m.names {
			if q := m.qs[name]; q.rated && m.rng.IntN(2) == 0 {
				m.setRate(ctx, q, 20+m.rng.IntN(31))
			}
		}
		if m.rng.IntN(2) == 0 {
			m.setKeyRate(ctx, m.qs["krate"], 2+m.rng.IntN(4))
		}
	}
	m.settle(ctx)
}

func runFlowModel(t *testing.T, seed int64, chaos time.Duration) {
	t.Logf("seed %d (replay: LEASH_MODEL_SEED=%d go test -race -count=1 -run TestModelFlow ./pool/)", seed, seed)
	m := newFlowModel(t, seed)
	ctx := context.Background()
	for range 3 + m.rng.IntN(2) {
		m.startPool()
	}
	defer func() {
		for len(m.pools) > 0 {
			m.stopPool(0)
		}
	}()
	for end := time.Now().Add(chaos); time.Now().Before(end); {
		m.step(ctx)
		time.Sleep(time.Duration(m.rng.IntN(30)) * time.Millisecond)
	}
	// (d) Everything drains: no job is left queued that a pool could claim.
	deadline := time.Now().Add(30 * time.Second)
	for {
		m.settle(ctx)
		var open int
		if err := m.db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state IN ('available', 'retryable', 'running')`).Scan(&open); err != nil {
			t.Fatal(err)
		}
		if open == 0 {
			break
		}
		if time.Now().After(deadline) {
			m.dumpStuck(ctx)
			t.Fatalf("seed %d: %d jobs still queued or running 30s after the chaos", seed, open)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for len(m.pools) > 0 {
		m.stopPool(0)
	}
	m.check(ctx)
}

// dumpStuck logs the jobs left unfinished and the keys' rows of their queues.
func (m *flowModel) dumpStuck(ctx context.Context) {
	rows, err := m.db.Query(ctx, `SELECT id, queue, coalesce(concurrency_key, ''), state, attempt, priority, run_at, attempted_at IS NOT NULL,
		(SELECT count(*) FROM leash.concurrency_keys c WHERE c.queue = j.queue AND c.key = j.concurrency_key),
		(SELECT count(*) FROM leash.key_wakes w WHERE w.queue = j.queue AND w.key = j.concurrency_key)
		FROM leash.jobs j WHERE state IN ('available', 'retryable', 'running') ORDER BY id LIMIT 30`)
	if err != nil {
		m.t.Log(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var queue, key, state string
		var attempt, rowsN, wakes int
		var prio int16
		var runAt time.Time
		var started bool
		if rows.Scan(&id, &queue, &key, &state, &attempt, &prio, &runAt, &started, &rowsN, &wakes) == nil {
			m.t.Logf("stuck: job %d %s/%s %s attempt %d priority %d run_at %s started %v; key rows %d, wakes %d",
				id, queue, key, state, attempt, prio, runAt.Format(time.RFC3339Nano), started, rowsN, wakes)
		}
	}
	var limits string
	m.db.QueryRow(ctx, `SELECT coalesce(string_agg(name || ':' || coalesce(max_running_per_key::text, '-'), ' '), '') FROM leash.queues`).Scan(&limits)
	m.t.Logf("per-key limits: %s", limits)
	arows, err := m.db.Query(ctx, `SELECT pid, state, coalesce(wait_event_type, ''), coalesce(wait_event, ''),
		extract(epoch FROM clock_timestamp() - xact_start)::float8, left(query, 160), pg_blocking_pids(pid)::text
		FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL`)
	if err != nil {
		m.t.Log(err)
		return
	}
	defer arows.Close()
	for arows.Next() {
		var pid int
		var state, wt, we, query, blockers string
		var age float64
		if arows.Scan(&pid, &state, &wt, &we, &age, &query, &blockers) == nil {
			m.t.Logf("backend %d %s wait %s/%s in a transaction for %.1fs blocked by %s: %s", pid, state, wt, we, age, blockers, query)
		}
	}
}

// checkWindows records a violation for each limit segment in which some window of period holds
// more starts of all than the segment's limit (what names whose starts they are), and returns the
// starts in order, the most in any window and how many windows were at the limit.
func (m *flowModel) checkWindows(all map[flowStart]bool, segs []rateSeg, period time.Duration, what string) (ats []int64, most, full int) {
	for s := range all {
		ats = append(ats, s.at)
	}
	slices.Sort(ats)
	for _, seg := range segs {
		from, until, p := seg.from.UnixMicro(), seg.until.UnixMicro(), period.Microseconds()
		for i, a := range ats {
			if a < from || a+p > until {
				continue
			}
			n, _ := slices.BinarySearch(ats, a+p)
			most = max(most, n-i)
			if n-i == seg.limit {
				full++
			}
			if n-i > seg.limit {
				m.violate("%s: %d starts in the %s from %s; the limit is %d", what, n-i, period,
					time.UnixMicro(a).UTC().Format(time.RFC3339Nano), seg.limit)
				break
			}
		}
	}
	return ats, most, full
}

func (m *flowModel) check(ctx context.Context) {
	t := m.t
	// (b) A sequential key's jobs never interleave: a job started again only right after its own
	// earlier start.
	for key, ids := range m.order {
		done := map[int64]bool{}
		for i := 1; i < len(ids); i++ {
			if ids[i] != ids[i-1] {
				done[ids[i-1]] = true
			}
			if done[ids[i]] {
				m.violate("sequential key %s/%s: job %d started again after another job of its key: %v", key[0], key[1], ids[i], ids)
				break
			}
		}
	}
	// (c) The starts of a rated queue, in the database (each job's last) and as the handlers saw
	// them (every attempt), in each window of the period that begins at a start after a change
	// committed and ends before the next one began.
	for _, name := range m.names {
		q := m.qs[name]
		if !q.rated {
			continue
		}
		all := maps.Clone(m.starts[name])
		rows, err := m.db.Query(ctx, `SELECT id, attempted_at FROM leash.jobs WHERE queue = $1 AND attempted_at IS NOT NULL`, name)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id int64
			var at time.Time
			if err := rows.Scan(&id, &at); err != nil {
				t.Fatal(err)
			}
			all[flowStart{id, at.UnixMicro()}] = true
		}
		rows.Close()
		ats, most, full := m.checkWindows(all, q.segs, q.period, "queue "+name)
		t.Logf("seed %d: queue %s: %d starts, at most %d in a window, %d windows at the limit (%d rate changes)",
			m.seed, name, len(ats), most, full, len(q.segs)-1)
	}
	// (e) The starts of each key of the key-rated queue, as (c) for the queue.
	q := m.qs["krate"]
	byKey := map[string]map[flowStart]bool{}
	for key, st := range m.keyStarts {
		byKey[key[1]] = maps.Clone(st)
	}
	rows, err := m.db.Query(ctx, `SELECT concurrency_key, id, attempted_at FROM leash.jobs
		WHERE queue = 'krate' AND concurrency_key IS NOT NULL AND attempted_at IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var key string
		var id int64
		var at time.Time
		if err := rows.Scan(&key, &id, &at); err != nil {
			t.Fatal(err)
		}
		if byKey[key] == nil {
			byKey[key] = map[flowStart]bool{}
		}
		byKey[key][flowStart{id, at.UnixMicro()}] = true
	}
	rows.Close()
	keyMost, keyFull, keyStarts := 0, 0, 0
	for key, all := range byKey {
		ats, most, full := m.checkWindows(all, q.keySegs, q.keyPeriod, "queue krate, key "+key)
		keyStarts += len(ats)
		keyMost, keyFull = max(keyMost, most), keyFull+full
	}
	t.Logf("seed %d: queue krate: %d starts of %d keys, at most %d of a key in a window, %d windows at the limit (%d changes)",
		m.seed, keyStarts, len(byKey), keyMost, keyFull, len(q.keySegs)-1)
	var total, completed int
	m.db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'completed') FROM leash.jobs`).Scan(&total, &completed)
	t.Logf("seed %d: %d jobs, %d completed, %d starts found their key at its limit; ops %v", m.seed, total, completed, m.atLimit, m.ops)
	if completed == 0 {
		m.violate("no job completed")
	}
	for _, v := range m.violations {
		t.Errorf("seed %d: %s", m.seed, v)
	}
}
