package pool_test

// A model-based randomized test of the job lifecycle.
//
// Each seed drives two or three real pools sharing one fresh database through a random
// interleaving of inserts (single, in a transaction, rolled back, InsertMany), scripted handler
// endings, revocations by every path (revoke_job, UPDATE revoked_at, bare NOTIFY, JSON NOTIFY
// with the token), forged, duplicated, stale and garbage notifications, listener kills, forced
// lease expiry (with and without an immediate rescue), pool shutdowns with replacements, and
// hostile rows other SQL clients write (model_hostile_test.go).
// What every handler did is recorded in memory (start, token, attempt, ending, the lease's cause
// when it ended and at return) and effects written through the fence go to a ledger table. After
// the chaos the pools drain everything, stop, and the final rows, the errors histories, the
// ledger and the in-memory records are checked against a model of the state machine (see
// check).
//
// The seed fixes the pools' configuration, every job's script and the driver's sequence of
// operations and pauses; goroutine scheduling and the database's timing are not seeded, so a
// replay re-runs the same scenario, not the same interleaving (replaying a failing seed a few
// times usually finds it again).
//
//	LEASH_MODEL_SEED=<n>  run only that seed (every failure message prints it)
//	LEASH_SOAK=1          run seeds for about three minutes, two at a time, with longer chaos
//	LEASH_TEST_LOG=1      the pools' logs on stderr

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/leasekeeper"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/notify"
	"github.com/leashq/leash/pool"
)

// Timings of the model's pools, and the bounds the checks allow for things that take time.
const (
	modelLease     = time.Second
	modelHeartbeat = 200 * time.Millisecond

	// modelReach bounds how long a committed revocation takes to reach a live holder: a
	// notification takes milliseconds; with the listener down, the next renewal (one
	// heartbeat) finds the revoked row. Generous for a loaded two-core machine under -race.
	modelReach = 2 * time.Second
	// modelExpirySlack bounds, beyond the lease duration, how long a rescuer takes to take back
	// a lease that stopped being renewed: the last renewal was sent before the lease ended, so
	// the row expires at most one lease (plus that statement's latency) after it ended, and
	// every pool runs a rescuer every 100-250ms.
	modelExpirySlack = 1800 * time.Millisecond
	// modelEps absorbs the conversion between the database clock and the test's clock.
	modelEps = 25 * time.Millisecond
	// modelDeliver bounds how long a notification takes to reach a connected listener on the
	// same machine (milliseconds; generous for -race on a loaded two-core machine).
	modelDeliver = 400 * time.Millisecond
	// modelLate absorbs a goroutine that records a lease's end late on a starved machine: the
	// trust window ends 200ms before the lease can expire, so a worker cut off stops first.
	modelLate = 200 * time.Millisecond
	// modelLongHold: a fenced transaction held longer than this waits on its context, as a
	// business transaction waiting on something would.
	modelLongHold = 500 * time.Millisecond

	// The stored form of error texts: cleaned and cut to 16 KiB plus a short note.
	modelMaxStoredText = 16<<10 + 64

	modelKind = "model"
)

// TestModel runs a few seeds (LEASH_MODEL_SEED: one given seed; LEASH_SOAK=1: about three
// minutes of seeds).
func TestModel(t *testing.T) {
	t.Parallel()
	soak := os.Getenv("LEASH_SOAK") != ""
	chaos := 6 * time.Second
	if soak {
		chaos = 12 * time.Second
	}
	if s := os.Getenv("LEASH_MODEL_SEED"); s != "" {
		seed, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("LEASH_MODEL_SEED=%q: %v", s, err)
		}
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runModelSeed(t, seed, chaos) })
		return
	}
	base := time.Now().UnixNano() % 1e12
	if soak {
		deadline := time.Now().Add(3 * time.Minute)
		for lane := range 2 {
			t.Run(fmt.Sprintf("lane%d", lane), func(t *testing.T) {
				t.Parallel()
				for i := int64(0); time.Now().Before(deadline); i++ {
					seed := base + int64(lane)*1e6 + i
					t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runModelSeed(t, seed, chaos) })
				}
			})
		}
		return
	}
	for i := range int64(3) {
		seed := base + i
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			runModelSeed(t, seed, chaos)
		})
	}
}

// modelReplayHint is the command that runs seed again.
func modelReplayHint(seed int64) string {
	soak := ""
	if os.Getenv("LEASH_SOAK") != "" {
		soak = "LEASH_SOAK=1 "
	}
	return fmt.Sprintf("%sLEASH_MODEL_SEED=%d go test -race -count=1 -run TestModel ./pool/", soak, seed)
}

func runModelSeed(t *testing.T, seed int64, chaos time.Duration) {
	t.Logf("seed %d (replay: %s)", seed, modelReplayHint(seed))
	m := newModel(t, seed)
	defer m.report() // also after a fatal failure: what was seen until then, and the seed
	m.run(chaos)
	m.check()
}

// mact is what a handler does in one attempt.
type mact uint8

const (
	actComplete   mact = iota // a little work honouring ctx, then nil
	actSlow                   // longer work honouring ctx, then nil
	actEffect                 // Fence + ledger row + CompleteTx in one transaction, then nil
	actEffectErr              // the same, then an error anyway
	actFail                   // an error
	actPermanent              // pool.Permanent
	actRetryAfter             // pool.RetryAfter
	actPanic                  // a panic with a hostile value
	actHostile                // an error with hostile bytes (NUL, invalid UTF-8, 100 kB)
	actBlock                  // wait for ctx (the job has a timeout), return its cause
	actBlockDeaf              // wait for ctx, then ignore it for a while
	actDeaf                   // ignore ctx for a while, then nil or an error
	actDeafLong               // timeout, then ignore ctx past the lease: a rescuer must take the job
)

var mactNames = [...]string{"complete", "slow", "effect", "effect+err", "fail", "permanent", "retry-after",
	"panic", "hostile", "block", "block+deaf", "deaf", "deaf-long"}

func (a mact) String() string { return mactNames[a] }

type mstep struct {
	act     mact
	d       time.Duration // work, sleep, RetryAfter delay or how long to ignore ctx
	hold    time.Duration // effect: how long the fenced transaction holds the row
	fail    bool          // deaf: return an error
	perm    bool          // hostile: Permanent
	hostile int           // which hostile text
}

func (s mstep) String() string {
	out := s.act.String()
	if s.d > 0 {
		out += "(" + s.d.Round(time.Millisecond).String() + ")"
	}
	if s.fail || s.perm {
		out += "!"
	}
	return out
}

// succeeds reports whether the step can return success (or complete through its effect).
func (s mstep) succeeds() bool {
	switch s.act {
	case actComplete, actSlow, actEffect, actEffectErr:
		return true
	case actDeaf, actDeafLong:
		return !s.fail
	}
	return false
}

// permanent reports whether the step's error fails the job at once.
func (s mstep) permanent() bool { return s.act == actPermanent || (s.act == actHostile && s.perm) }

// mjob is the model of one job: its script and what the driver did to it.
type mjob struct {
	k        int
	id       int64
	inserted bool
	quiet    bool // never revoked nor forced to expire by the driver (forged notifications still come)
	max      int
	timeout  time.Duration
	script   []mstep // by attempt

	revokes []mrevoke
	forced  []mforced
	forged  []int64 // tokens named by forged takeover notifications
	wrong   int     // revocations with a wrong token
	execs   []*mexec
}

// successOnly reports whether nothing in the script can fail by itself.
func (j *mjob) successOnly() bool {
	for _, s := range j.script {
		if s.act != actComplete && s.act != actSlow && s.act != actEffect {
			return false
		}
	}
	return j.timeout == 0
}

type mrevoke struct {
	how        string // revoke_job, update, notify, notify-token
	durable    bool   // revoke_job returned true / the UPDATE changed the row
	token      int64
	start, end time.Time
	holder     *mpool // notify: the pool running the claim named, when known
	connected  bool   // notify: its listener was connected when it was sent
}

type mforced struct {
	token  int64
	rescue bool
	at     time.Time
}

// mexec is one handler run: the in-memory ledger.
type mexec struct {
	job         *mjob
	id, token   int64
	attempt     int
	pool        *mpool
	step        mstep
	start       time.Time
	attemptedAt time.Time // the claim's time, database clock converted to ours

	mu            sync.Mutex
	returned      time.Time
	err           error
	panicked      bool
	causeSeen     error     // the lease's cause when the handler's context ended while it ran
	causeAt       time.Time // when that was seen
	causeAtReturn error     // the lease's cause when the handler returned; nil if it still held
	effect        bool      // its fenced transaction committed
	commitStart   time.Time
	heldChecked   bool
	heldAtReturn  bool
	heldAfter     time.Duration
}

func (e *mexec) ok() bool { return e.err == nil && !e.panicked }

func (e *mexec) seeCause(c error, at time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.causeSeen == nil && c != nil {
		e.causeSeen, e.causeAt = c, at
	}
}

type mpool struct {
	id         string
	p          *pool.Pool
	done       chan error
	stopping   bool
	shutdownAt time.Time // a shutdown during the chaos
}

type model struct {
	t      *testing.T
	seed   int64
	replay string // how to run this seed again
	// Separate streams, so that a replay keeps the pools, the jobs' scripts and the sequence of
	// operations even where the targets (which depend on timing) differ.
	rng     *rand.Rand    // operations and pauses
	jobRng  *rand.Rand    // jobs and their scripts
	poolRng *rand.Rand    // pools' configurations
	tgtRng  *rand.Rand    // targets and details of operations
	hostRng *rand.Rand    // hostile rows other clients write (model_hostile_test.go)
	drv     *pgxpool.Pool // the driver's connections
	app     *pgxpool.Pool // the pools' and handlers' connections
	skew    time.Duration // database clock minus ours
	t0      time.Time

	mu      sync.Mutex
	jobs    []*mjob
	byID    map[int64]*mjob
	started map[[2]int64]bool
	hostile map[int64]*mhostile // by id

	stranger *mstranger // a role without grants (model_stranger_test.go), once drawn

	pools    []*mpool
	nextPool int
	lastStop time.Time
	kills    []time.Time // listener kills

	deliveredChecked, deliveredEnded int // notifications rule 12 could judge; of them, to leases ended otherwise
	handlers                         sync.WaitGroup
	ops                              map[string]int
	vmu                              sync.Mutex
	viol                             []string
	violJobs                         map[int]bool
	staleSeen                        atomic.Int64
}

func newModel(t *testing.T, seed int64) *model {
	url := pgtest.URL(t)
	stream := func(n uint64) *rand.Rand { return rand.New(rand.NewPCG(uint64(seed), 0x1ea5+n)) }
	m := &model{t: t, seed: seed, replay: modelReplayHint(seed), rng: stream(0), jobRng: stream(1), poolRng: stream(2),
		tgtRng: stream(3), hostRng: stream(4), drv: pgtest.PoolFor(t, url), hostile: map[int64]*mhostile{},
		byID: map[int64]*mjob{}, started: map[[2]int64]bool{}, ops: map[string]int{}, violJobs: map[int]bool{}}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		m.fatalf("parse %q: %v", url, err)
	}
	cfg.MaxConns = 24
	if m.app, err = pgxpool.NewWithConfig(context.Background(), cfg); err != nil {
		m.fatalf("app pool: %v", err)
	}
	t.Cleanup(m.app.Close)
	// Registered after the connection pools: runs before they close.
	t.Cleanup(m.stopAll)
	ctx := context.Background()
	if _, err := m.drv.Exec(ctx, `CREATE TABLE model_ledger (
		job_id bigint NOT NULL, token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		m.fatalf("create ledger: %v", err)
	}
	m.addOldRows(ctx)
	best := time.Hour
	for range 5 {
		before := time.Now()
		var db time.Time
		if err := m.drv.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&db); err != nil {
			m.fatalf("read database clock: %v", err)
		}
		after := time.Now()
		if rtt := after.Sub(before); rtt < best {
			best, m.skew = rtt, db.Sub(before.Add(rtt/2))
		}
	}
	return m
}

// local converts a database timestamp to the test's clock.
func (m *model) local(db time.Time) time.Time { return db.Add(-m.skew) }

func (m *model) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf("seed %d: "+format+" (replay: %s)", append(append([]any{m.seed}, args...), m.replay)...)
}

// violate records a broken rule about job j (nil: not about one job).
func (m *model) violate(j *mjob, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	m.vmu.Lock()
	defer m.vmu.Unlock()
	if j != nil {
		msg = fmt.Sprintf("job %d (k=%d): %s", j.id, j.k, msg)
		m.violJobs[j.k] = true
	}
	m.viol = append(m.viol, msg)
}

func (m *model) rel(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return fmt.Sprintf("+%.3fs", t.Sub(m.t0).Seconds())
}

// modelDur draws a duration between lo and hi milliseconds.
func modelDur(r *rand.Rand, lo, hi int) time.Duration {
	return time.Duration(lo+r.IntN(hi-lo+1)) * time.Millisecond
}

// ---- pools and handlers ----

func (m *model) startPool() *mpool {
	n := m.nextPool
	m.nextPool++
	retry := modelDur(m.poolRng, 0, 30)
	// The claim loop's shape, drawn apart from poolRng so that earlier seeds replay as they did.
	shape := rand.New(rand.NewPCG(uint64(m.seed), 0x5a1e+uint64(n)))
	cfg := pool.Config{
		ID:                fmt.Sprintf("model-%d-w%d", m.seed%10000, n),
		Concurrency:       3 + m.poolRng.IntN(3),
		LeaseDuration:     modelLease,
		HeartbeatInterval: modelHeartbeat,
		RescueInterval:    modelDur(m.poolRng, 100, 250),
		PollInterval:      modelDur(m.poolRng, 40, 150),
		ShutdownTimeout:   time.Second,
		ShutdownStallWait: modelDur(m.poolRng, 50, 300),
		// One literal, so that poolRng is drawn in the same order as ever (shape is its own).
		Engine: pool.EngineConfig{FinishFlushInterval: modelDur(m.poolRng, 1, 20),
			ClaimsInFlight: 1 + shape.IntN(2), ClaimGather: modelDur(shape, 0, 5)},
		ListenReconnectDelay: modelDur(m.poolRng, 200, 1000),
		ListenPingInterval:   modelDur(m.poolRng, 1000, 3000),
		RetryBackoff:         func(int) time.Duration { return retry },
	}
	if os.Getenv("LEASH_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	p, err := pool.New(m.app, cfg)
	if err != nil {
		m.fatalf("pool.New: %v", err)
	}
	mp := &mpool{id: cfg.ID, p: p, done: make(chan error, 1)}
	if err := p.Register(modelKind, pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		return m.handle(ctx, j, mp)
	})); err != nil {
		m.fatalf("register: %v", err)
	}
	if err := p.Register(modelHostileKind, pool.HandlerFunc(m.handleHostile)); err != nil {
		m.fatalf("register: %v", err)
	}
	m.pools = append(m.pools, mp)
	go func() { mp.done <- p.Run(context.Background()) }()
	return mp
}

// stopAll stops whatever still runs when a test ends early.
func (m *model) stopAll() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a hard stop
	for _, mp := range m.pools {
		go mp.p.Shutdown(ctx)
	}
	deadline := time.After(15 * time.Second)
	for _, mp := range m.pools {
		select {
		case <-mp.done:
			mp.done <- nil // for the next reader
		case <-deadline:
			m.t.Errorf("seed %d: pool %s did not stop within 15s at cleanup", m.seed, mp.id)
			return
		}
	}
	wait := make(chan struct{})
	go func() { m.handlers.Wait(); close(wait) }()
	select {
	case <-wait:
	case <-time.After(15 * time.Second):
		m.t.Errorf("seed %d: handlers still running 15s after every pool stopped", m.seed)
	}
}

// handle is every pool's handler: it looks up the job's script, records the run and plays the
// step for this attempt.
func (m *model) handle(ctx context.Context, j *pool.Job, mp *mpool) (err error) {
	var pl struct {
		K int `json:"k"`
	}
	if e := json.Unmarshal(j.Payload, &pl); e != nil {
		m.violate(nil, "job %d: payload %s: %v", j.ID, j.Payload, e)
		return pool.Permanent(e)
	}
	m.mu.Lock()
	if pl.K < 0 || pl.K >= len(m.jobs) {
		m.mu.Unlock()
		m.violate(nil, "job %d: unknown model key %d", j.ID, pl.K)
		return pool.Permanent(errors.New("unknown job"))
	}
	mj := m.jobs[pl.K]
	e := &mexec{job: mj, id: j.ID, token: j.Token, attempt: j.Attempt, pool: mp, start: time.Now(),
		attemptedAt: m.local(j.AttemptedAt)}
	e.step = mj.script[min(max(j.Attempt, 1), len(mj.script))-1]
	key := [2]int64{j.ID, j.Token}
	dup := m.started[key]
	m.started[key] = true
	if mj.id == 0 {
		mj.id = j.ID
		m.byID[j.ID] = mj
	}
	mj.execs = append(mj.execs, e)
	inserted, id := mj.inserted, mj.id
	m.handlers.Add(1)
	m.mu.Unlock()
	defer m.handlers.Done()
	if dup {
		m.violate(mj, "handler started twice under token %d", j.Token)
	}
	if id != j.ID {
		m.violate(mj, "model key also ran as job %d", j.ID)
	}
	if !inserted {
		m.violate(mj, "a job whose insert was rolled back ran (token %d)", j.Token)
	}
	stop := context.AfterFunc(ctx, func() { e.seeCause(context.Cause(ctx), time.Now()) })
	defer func() {
		r := recover()
		stop()
		now := time.Now()
		cause := pool.LeaseCause(j)
		e.seeCause(cause, now)
		e.mu.Lock()
		e.returned, e.err, e.panicked, e.causeAtReturn = now, err, r != nil, cause
		e.mu.Unlock()
		if r != nil {
			panic(r)
		}
	}()
	return m.play(ctx, j, e)
}

func modelHostileText(i int) string {
	switch i % 5 {
	case 0:
		return "nul\x00in\x00the\x00middle\x00"
	case 1:
		return "invalid utf-8 \xff\xfe\xc3( \xed\xa0\x80 surrogate"
	case 2:
		return "huge " + strings.Repeat("x", 100_000)
	case 3:
		return "all of it \x00\xff" + strings.Repeat("\x00é\xff", 35_000)
	default:
		return "trailing cut é" + strings.Repeat("é", 9_000) + "\xc3"
	}
}

// play runs the step. Every error it returns starts with the claim's marker mk<k>t<token>|, so
// that each entry in a job's errors history can be traced to the claim that wrote it.
func (m *model) play(ctx context.Context, j *pool.Job, e *mexec) error {
	s := e.step
	marker := fmt.Sprintf("mk%dt%d|", e.job.k, j.Token)
	switch s.act {
	case actComplete, actSlow:
		if err := pool.Sleep(ctx, s.d); err != nil {
			return fmt.Errorf("%s interrupted: %w", marker, err)
		}
		return nil
	case actEffect, actEffectErr:
		if err := pool.Sleep(ctx, s.d); err != nil {
			return fmt.Errorf("%s interrupted: %w", marker, err)
		}
		if err := m.effect(ctx, j, e, s.hold); err != nil {
			return fmt.Errorf("%s effect: %w", marker, err)
		}
		if s.act == actEffectErr {
			return errors.New(marker + " error after the effect committed")
		}
		return nil
	case actFail:
		_ = pool.Sleep(ctx, s.d)
		return errors.New(marker + " fail")
	case actPermanent:
		return pool.Permanent(errors.New(marker + " permanent"))
	case actRetryAfter:
		return pool.RetryAfter(s.d, errors.New(marker+" retry after"))
	case actPanic:
		if s.hostile%2 == 0 {
			panic(marker + " " + modelHostileText(s.hostile))
		}
		panic(errors.New(marker + " " + modelHostileText(s.hostile)))
	case actHostile:
		err := errors.New(marker + " " + modelHostileText(s.hostile))
		if s.perm {
			return pool.Permanent(err)
		}
		return err
	case actBlock:
		<-ctx.Done()
		return fmt.Errorf("%s blocked until: %w", marker, context.Cause(ctx))
	case actBlockDeaf:
		<-ctx.Done()
		time.Sleep(s.d) // ignoring the cancellation for a while
		return fmt.Errorf("%s blocked, then ignored: %w", marker, context.Cause(ctx))
	case actDeaf, actDeafLong:
		time.Sleep(s.d) // ignoring ctx altogether
		if s.act == actDeafLong {
			m.checkHeld(j, e)
		}
		if s.fail {
			return errors.New(marker + " deaf handler failed")
		}
		return nil
	}
	panic("unknown step")
}

// effect writes the job's effect in a fenced transaction that completes the job.
func (m *model) effect(ctx context.Context, j *pool.Job, e *mexec, hold time.Duration) error {
	tx, err := m.app.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.Background())
	if err := j.Fence(ctx, tx); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO model_ledger (job_id, token) VALUES ($1, $2)`, j.ID, j.Token); err != nil {
		return err
	}
	if hold > modelLongHold {
		// A fenced transaction longer than the trust window: its lease must hold all along, and a
		// revocation must reach it at once and keep it from committing.
		if err := pool.Sleep(ctx, hold); err != nil {
			return err
		}
	} else {
		time.Sleep(hold) // a slow business transaction holds the job's row
	}
	if err := j.CompleteTx(ctx, tx); err != nil {
		return err
	}
	e.mu.Lock()
	e.commitStart = time.Now()
	e.mu.Unlock()
	if err := tx.Commit(context.Background()); err != nil {
		return err
	}
	e.mu.Lock()
	e.effect = true
	e.mu.Unlock()
	return nil
}

// checkHeld runs when a handler that ignored its cancellation returns long after its lease
// ended: by then a rescuer must have taken the job back, since an ended lease is never renewed.
func (m *model) checkHeld(j *pool.Job, e *mexec) {
	e.mu.Lock()
	at := e.causeAt
	e.mu.Unlock()
	if at.IsZero() || time.Since(at) < modelLease+modelExpirySlack {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var held bool
	err := m.drv.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM leash.jobs WHERE id = $1 AND lease_token = $2 AND state = 'running')`,
		j.ID, j.Token).Scan(&held)
	if err != nil {
		m.violate(e.job, "reading the row: %v", err)
		return
	}
	e.mu.Lock()
	e.heldChecked, e.heldAtReturn, e.heldAfter = true, held, time.Since(at)
	e.mu.Unlock()
}

// ---- the driver ----

func (m *model) newJob() *mjob {
	mj := &mjob{k: len(m.jobs), max: 1 + m.jobRng.IntN(4)}
	successOnly := m.jobRng.IntN(10) < 3
	if !successOnly && m.jobRng.IntN(4) == 0 {
		mj.timeout = modelDur(m.jobRng, 100, 350)
	}
	mj.script = make([]mstep, mj.max)
	for a := range mj.script {
		mj.script[a] = m.newStep(mj, a, successOnly)
	}
	// Quiet jobs show what nothing but their script does to them: success-only ones must
	// complete at once, and one that ignores its timeout past the lease must be taken back.
	switch {
	case successOnly, mj.script[0].act == actDeafLong:
		mj.quiet = m.jobRng.IntN(2) == 0
	default:
		mj.quiet = m.jobRng.IntN(10) == 0
	}
	m.mu.Lock()
	m.jobs = append(m.jobs, mj)
	m.mu.Unlock()
	return mj
}

func (m *model) newStep(mj *mjob, attempt int, successOnly bool) mstep {
	s := mstep{}
	hostile, perm, fail := m.jobRng.IntN(5), m.jobRng.IntN(3) == 0, m.jobRng.IntN(2) == 0
	if successOnly {
		switch w := m.jobRng.IntN(100); {
		case w < 45:
			s.act, s.d = actComplete, modelDur(m.jobRng, 0, 20)
		case w < 85:
			s.act, s.d, s.hold = actEffect, modelDur(m.jobRng, 0, 40), modelDur(m.jobRng, 0, 40)
		default:
			s.act, s.d = actSlow, modelDur(m.jobRng, 200, 2500)
		}
		return s
	}
	if mj.timeout > 0 && attempt == 0 && m.jobRng.IntN(2) == 0 {
		s.act, s.d, s.fail = actDeafLong, mj.timeout+modelDur(m.jobRng, 3000, 3400), m.jobRng.IntN(3) == 0
		return s
	}
	weights := []struct {
		a mact
		w int
	}{{actComplete, 16}, {actSlow, 8}, {actEffect, 16}, {actEffectErr, 2}, {actFail, 10}, {actPermanent, 4},
		{actRetryAfter, 7}, {actPanic, 5}, {actHostile, 9}, {actBlock, 5}, {actBlockDeaf, 3}, {actDeaf, 5}}
	total := 0
	for _, w := range weights {
		total += w.w
	}
	n := m.jobRng.IntN(total)
	for _, w := range weights {
		if n < w.w {
			s.act = w.a
			break
		}
		n -= w.w
	}
	if (s.act == actBlock || s.act == actBlockDeaf) && mj.timeout == 0 {
		s.act = actSlow
	}
	switch s.act {
	case actComplete, actFail, actPermanent:
		s.d = modelDur(m.jobRng, 0, 20)
	case actPanic:
		s.hostile = hostile
	case actHostile:
		s.hostile, s.perm = hostile, perm
	case actSlow:
		s.d = modelDur(m.jobRng, 200, 2500)
	case actEffect, actEffectErr:
		s.d, s.hold = modelDur(m.jobRng, 0, 40), modelDur(m.jobRng, 0, 60)
		if m.jobRng.IntN(5) == 0 {
			s.hold = modelDur(m.jobRng, 900, 2200) // longer than the trust window, up to two leases
		}
	case actRetryAfter:
		s.d = modelDur(m.jobRng, 0, 40)
	case actBlockDeaf:
		s.d = modelDur(m.jobRng, 100, 1500)
	case actDeaf:
		s.d, s.fail = modelDur(m.jobRng, 100, 1200), fail
	}
	return s
}

// run drives the pools for chaos, then lets them drain and stops them.
func (m *model) run(chaos time.Duration) {
	m.t0 = time.Now()
	for range 2 + m.poolRng.IntN(2) {
		m.startPool()
	}
	ctx := context.Background()
	until := time.Now().Add(chaos)
	for time.Now().Before(until) && !m.t.Failed() {
		time.Sleep(modelDur(m.rng, 5, 40)) // a random pause: part of the interleaving
		m.step(ctx)
	}
	m.settle(ctx)
}

func (m *model) step(ctx context.Context) {
	switch w := m.rng.IntN(100); {
	case w < 17:
		m.opInsert(ctx)
	case w < 25:
		m.opInsertMany(ctx)
	case w < 32:
		m.opRevokeJob(ctx)
	case w < 37:
		m.opRevokeUpdate(ctx)
	case w < 45:
		m.opNotifyBare(ctx)
	case w < 53:
		m.opNotifyToken(ctx)
	case w < 63:
		m.opForgedTakeover(ctx)
	case w < 69:
		m.opWrongToken(ctx)
	case w < 74:
		m.opGarbage(ctx)
	case w < 77:
		m.opKillListeners(ctx)
	case w < 84:
		m.opForceExpiry(ctx)
	case w < 86:
		m.opShutdown()
	case w < 90:
		m.opHostile(ctx) // its own stream: the draws above replay as before
	case w < 93:
		m.opStranger(ctx) // its own stream too
	}
}

func (m *model) sql(ctx context.Context, sql string, args ...any) int64 {
	m.t.Helper()
	tag, err := m.drv.Exec(ctx, sql, args...)
	if err != nil {
		m.fatalf("%s: %v", sql, err)
	}
	return tag.RowsAffected()
}

// open counts jobs not final yet.
func (m *model) open(ctx context.Context) int {
	var n int
	if err := m.drv.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled')`).Scan(&n); err != nil {
		m.fatalf("count open jobs: %v", err)
	}
	return n
}

// pick chooses one job among those in states (ordered by id, so that the seed decides which),
// returning its id and current token (0 when not running). Quiet jobs are left out unless
// quietToo.
func (m *model) pick(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, quietToo bool, states ...string) (*mjob, int64, bool) {
	return m.pickWhere(ctx, db, quietToo, "true", nil, states...)
}

// pickWhere is pick among the rows that also match where and, unless nil, keep (called with
// m.mu held).
func (m *model) pickWhere(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, quietToo bool, where string, keep func(*mjob, int64) bool, states ...string) (*mjob, int64, bool) {
	rows, err := db.Query(ctx, `SELECT id, coalesce(lease_token, 0) FROM leash.jobs WHERE state = ANY($1) AND `+where+` ORDER BY id`, states)
	if err != nil {
		m.fatalf("pick a job: %v", err)
	}
	type cand struct{ id, token int64 }
	cands, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (cand, error) {
		var c cand
		return c, r.Scan(&c.id, &c.token)
	})
	if err != nil {
		m.fatalf("pick a job: %v", err)
	}
	m.mu.Lock()
	cands = slices.DeleteFunc(cands, func(c cand) bool {
		mj := m.byID[c.id]
		return mj == nil || mj.quiet && !quietToo || keep != nil && !keep(mj, c.token)
	})
	var mj *mjob
	var c cand
	if len(cands) > 0 {
		c = cands[m.tgtRng.IntN(len(cands))]
		mj = m.byID[c.id]
	}
	m.mu.Unlock()
	if mj == nil {
		return nil, 0, false
	}
	return mj, c.token, true
}

// pickTarget prefers running jobs, which have a holder to tell.
func (m *model) pickTarget(ctx context.Context) (*mjob, int64, bool) {
	if m.tgtRng.IntN(10) < 6 {
		if mj, tok, ok := m.pick(ctx, m.drv, false, "running"); ok {
			return mj, tok, true
		}
	}
	return m.pick(ctx, m.drv, false, "available", "retryable", "running")
}

func (m *model) record(mj *mjob, op mrevoke) {
	m.mu.Lock()
	mj.revokes = append(mj.revokes, op)
	m.mu.Unlock()
}

func (m *model) reason() string {
	switch m.tgtRng.IntN(4) {
	case 0:
		return ""
	case 1:
		return "operator said so ✋"
	case 2:
		return strings.Repeat("ü", 700) // beyond the stored limit
	default:
		return "model " + strconv.Itoa(m.tgtRng.IntN(1000))
	}
}

func (m *model) opInsert(ctx context.Context) {
	if m.open(ctx) > 60 {
		return
	}
	m.ops["insert"]++
	mj := m.newJob()
	opts := &pool.InsertOpts{MaxAttempts: mj.max, Timeout: mj.timeout, Priority: int16(m.jobRng.IntN(3) - 1)}
	payload := map[string]int{"k": mj.k}
	var id int64
	var err error
	mode, commit := m.jobRng.IntN(10), m.jobRng.IntN(2) == 0
	// A worker may start the job before the insert returns here.
	m.mu.Lock()
	mj.inserted = mode > 1 || commit
	m.mu.Unlock()
	switch mode {
	case 0, 1: // in a transaction, sometimes rolled back
		tx, terr := m.drv.Begin(ctx)
		if terr != nil {
			m.fatalf("begin: %v", terr)
		}
		id, err = pool.InsertTx(ctx, tx, modelKind, payload, opts)
		if err == nil && commit {
			err = tx.Commit(ctx)
		} else {
			tx.Rollback(ctx)
			if err == nil {
				m.ops["insert-rolled-back"]++
				return // never inserted: must never run
			}
		}
	default:
		id, err = pool.Insert(ctx, m.drv, modelKind, payload, opts)
	}
	if err != nil {
		m.fatalf("insert: %v", err)
	}
	m.mu.Lock()
	if mj.id != 0 && mj.id != id {
		m.mu.Unlock()
		m.fatalf("key %d ran as job %d but was inserted as %d", mj.k, mj.id, id)
	}
	mj.id = id
	m.byID[id] = mj
	m.mu.Unlock()
	if m.jobRng.IntN(8) == 0 && !mj.quiet { // revoked at once, before any worker can have it (usually)
		m.revokeNow(ctx, mj)
	}
}

func (m *model) opInsertMany(ctx context.Context) {
	if m.open(ctx) > 60 {
		return
	}
	m.ops["insert-many"]++
	n := 2 + m.jobRng.IntN(6)
	params := make([]pool.InsertManyParams, n)
	keys := make([]int, n)
	jobs := make([]*mjob, n)
	for i := range params {
		mj := m.newJob()
		jobs[i], keys[i] = mj, mj.k
		params[i] = pool.InsertManyParams{Kind: modelKind, Payload: map[string]int{"k": mj.k},
			Opts: &pool.InsertOpts{MaxAttempts: mj.max, Timeout: mj.timeout}}
	}
	// Claims may start before the ids are read back: the handler maps jobs by their key.
	m.mu.Lock()
	for _, mj := range jobs {
		mj.inserted = true
	}
	m.mu.Unlock()
	if got, err := pool.InsertMany(ctx, m.drv, params); err != nil || got != int64(n) {
		m.fatalf("InsertMany: %d of %d, %v", got, n, err)
	}
	rows, err := m.drv.Query(ctx, `SELECT id, (payload->>'k')::int FROM leash.jobs WHERE (payload->>'k')::int = ANY($1)`, keys)
	if err != nil {
		m.fatalf("read inserted ids: %v", err)
	}
	type idk struct {
		id int64
		k  int
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (idk, error) {
		var x idk
		return x, r.Scan(&x.id, &x.k)
	})
	if err != nil || len(got) != n {
		m.fatalf("read inserted ids: %d of %d, %v", len(got), n, err)
	}
	m.mu.Lock()
	for _, x := range got {
		mj := m.jobs[x.k]
		if mj.id != 0 && mj.id != x.id {
			m.mu.Unlock()
			m.fatalf("key %d ran as job %d but was inserted as %d", x.k, mj.id, x.id)
		}
		mj.id = x.id
		m.byID[x.id] = mj
	}
	m.mu.Unlock()
	if mj := jobs[m.jobRng.IntN(n)]; m.jobRng.IntN(4) == 0 && !mj.quiet {
		m.revokeNow(ctx, mj)
	}
}

// revokeNow revokes a job just inserted, durably.
func (m *model) revokeNow(ctx context.Context, mj *mjob) {
	m.ops["revoke-at-insert"]++
	start := time.Now()
	if m.jobRng.IntN(2) == 0 {
		var ok bool
		if err := m.drv.QueryRow(ctx, `SELECT leash.revoke_job($1, 'at insert')`, mj.id).Scan(&ok); err != nil {
			m.fatalf("revoke_job: %v", err)
		}
		m.record(mj, mrevoke{how: "revoke_job", durable: ok, start: start, end: time.Now()})
		return
	}
	n := m.sql(ctx, `UPDATE leash.jobs SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL
		AND state IN ('available', 'retryable', 'running')`, mj.id)
	m.record(mj, mrevoke{how: "update", durable: n == 1, start: start, end: time.Now()})
}

func (m *model) opRevokeJob(ctx context.Context) {
	mj, tok, ok := m.pickTarget(ctx)
	if !ok {
		return
	}
	m.ops["revoke_job"]++
	for again := true; again; again = m.tgtRng.IntN(5) == 0 { // sometimes twice: a reminder
		start := time.Now()
		var res bool
		if err := m.drv.QueryRow(ctx, `SELECT leash.revoke_job($1, nullif($2, ''))`, mj.id, m.reason()).Scan(&res); err != nil {
			m.fatalf("revoke_job: %v", err)
		}
		m.record(mj, mrevoke{how: "revoke_job", durable: res, token: tok, start: start, end: time.Now()})
	}
}

// opRevokeUpdate is the console's UPDATE, guarded so that it never marks a finished job (an
// unguarded UPDATE of a finished row would only add a meaningless revoked_at).
func (m *model) opRevokeUpdate(ctx context.Context) {
	mj, tok, ok := m.pickTarget(ctx)
	if !ok {
		return
	}
	m.ops["update"]++
	start := time.Now()
	n := m.sql(ctx, `UPDATE leash.jobs SET revoked_at = now(), revoke_reason = nullif($2, '') WHERE id = $1
		AND revoked_at IS NULL AND state IN ('available', 'retryable', 'running')`, mj.id, m.reason())
	m.record(mj, mrevoke{how: "update", durable: n == 1, token: tok, start: start, end: time.Now()})
}

func (m *model) notify(ctx context.Context, payload string) {
	m.sql(ctx, `SELECT pg_notify('job_revoked', $1)`, payload)
}

// pickNotifyTarget picks a running job, half the time one that looks stuck (no heartbeat for
// two heartbeats: its lease ended, for instance timed out, while its handler runs on), as an
// operator would.
func (m *model) pickNotifyTarget(ctx context.Context) (*mjob, int64, bool) {
	if m.tgtRng.IntN(2) == 0 {
		if mj, tok, ok := m.pickWhere(ctx, m.drv, false, "heartbeat_at < now() - interval '400 milliseconds' AND revoked_at IS NULL", nil, "running"); ok {
			return mj, tok, true
		}
	}
	return m.pick(ctx, m.drv, false, "running")
}

func (m *model) opNotifyBare(ctx context.Context) {
	mj, tok, ok := m.pickNotifyTarget(ctx)
	if !ok {
		return
	}
	m.ops["notify"]++
	holder, connected := m.holder(mj, tok)
	start := time.Now()
	pad := strings.Repeat(" ", m.tgtRng.IntN(3))
	m.sql(ctx, fmt.Sprintf("NOTIFY job_revoked, '%s%d%s'", pad, mj.id, pad))
	if m.tgtRng.IntN(4) == 0 { // a duplicate
		m.sql(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", mj.id))
	}
	m.record(mj, mrevoke{how: "notify", token: tok, start: start, end: time.Now(), holder: holder, connected: connected})
}

func (m *model) opNotifyToken(ctx context.Context) {
	mj, tok, ok := m.pickNotifyTarget(ctx)
	if !ok {
		return
	}
	m.ops["notify-token"]++
	msg := map[string]any{"id": mj.id, "token": tok}
	switch m.tgtRng.IntN(4) {
	case 0:
		msg["reason"] = "bad \x00 batch \xff"
	case 1:
		msg["reason"] = strings.Repeat("é", 200)
	case 2:
		msg["reason"] = "model"
	}
	b, _ := json.Marshal(msg)
	holder, connected := m.holder(mj, tok)
	start := time.Now()
	m.notify(ctx, string(b))
	if m.tgtRng.IntN(4) == 0 {
		m.notify(ctx, string(b)+" ") // a duplicate (an identical payload would be merged)
	}
	m.record(mj, mrevoke{how: "notify-token", token: tok, start: start, end: time.Now(), holder: holder, connected: connected})
}

// holder returns the pool running job mj's claim tok, if its handler has started, and whether
// that pool's listener is connected.
func (m *model) holder(mj *mjob, tok int64) (*mpool, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range mj.execs {
		if e.token == tok {
			return e.pool, e.pool.p.ListenerConnected()
		}
	}
	return nil, false
}

// opForgedTakeover sends what a rescuer sends, for a job nobody took over: anyone who can
// connect can. It must change nothing.
func (m *model) opForgedTakeover(ctx context.Context) {
	mj, tok, ok := m.pick(ctx, m.drv, true, "running")
	if !ok {
		return
	}
	m.ops["forged-takeover"]++
	p := fmt.Sprintf(`{"id":%d,"token":%d,"reason":"lease expired","takeover":true}`, mj.id, tok)
	m.notify(ctx, p)
	if m.tgtRng.IntN(3) == 0 {
		m.notify(ctx, fmt.Sprintf(`{"id":%d,"token":%d,"takeover":true}`, mj.id, tok))
	}
	m.mu.Lock()
	mj.forged = append(mj.forged, tok)
	m.mu.Unlock()
}

// opWrongToken sends revocations naming a claim that is not the job's current one: an earlier
// claim of it, a token never issued, or another job's token. They must change nothing.
func (m *model) opWrongToken(ctx context.Context) {
	mj, tok, ok := m.pick(ctx, m.drv, true, "running")
	if m.tgtRng.IntN(2) == 0 {
		// Rather a job running again while an earlier, taken-over claim's handler still runs
		// (a stale notification then reaches a worker that still has that claim).
		if smj, stok, sok := m.pickWhere(ctx, m.drv, true, "true", m.staleRunning, "running"); sok {
			mj, tok, ok = smj, stok, true
			m.ops["wrong-token-earlier-running"]++
		}
	}
	if !ok {
		return
	}
	m.ops["wrong-token"]++
	wrong := tok + 1_000_000_000
	m.mu.Lock()
	var older, stillRunning []int64
	for _, e := range mj.execs {
		if e.token < tok {
			older = append(older, e.token)
			e.mu.Lock()
			if e.returned.IsZero() { // taken over, its handler still running somewhere
				stillRunning = append(stillRunning, e.token)
			}
			e.mu.Unlock()
		}
	}
	mj.wrong++
	m.mu.Unlock()
	switch m.tgtRng.IntN(4) {
	case 0, 1:
		if len(stillRunning) > 0 {
			wrong = stillRunning[m.tgtRng.IntN(len(stillRunning))]
		} else if len(older) > 0 {
			wrong = older[m.tgtRng.IntN(len(older))]
		}
	case 2:
		if other, otok, ok := m.pick(ctx, m.drv, true, "running"); ok && other != mj {
			wrong = otok
		}
	}
	m.notify(ctx, fmt.Sprintf(`{"id":%d,"token":%d,"reason":"stale"}`, mj.id, wrong))
}

// staleRunning reports whether a claim of mj earlier than tok still has its handler running.
// m.mu is held.
func (m *model) staleRunning(mj *mjob, tok int64) bool {
	for _, e := range mj.execs {
		e.mu.Lock()
		running := e.returned.IsZero()
		e.mu.Unlock()
		if e.token < tok && running {
			return true
		}
	}
	return false
}

func (m *model) opGarbage(ctx context.Context) {
	m.ops["garbage"]++
	id := int64(1)
	if mj, _, ok := m.pick(ctx, m.drv, true, "running"); ok {
		id = mj.id
	}
	junk := []string{"", "\t", "abc", "-1", "0", "1.5", "99999999999999999999999", fmt.Sprintf(`{"id":"%d"}`, id),
		fmt.Sprintf(`{"id":%d,"x":2}`, id), `{"id":`, fmt.Sprintf("[%d]", id), "null", fmt.Sprintf(`{"id":%d,"token":-4}`, id),
		fmt.Sprintf(`{"id":%d,"takeover":true}`, id), fmt.Sprintf(`{"id":%d}{"id":%d}`, id, id),
		// Valid but longer than any payload is allowed to be.
		fmt.Sprintf(`{"id":%d,"reason":"%s"}`, id, strings.Repeat("x", notify.MaxPayload)),
		fmt.Sprintf("%d%s", id, strings.Repeat(" ", notify.MaxPayload))}
	for range 1 + m.tgtRng.IntN(3) {
		m.notify(ctx, junk[m.tgtRng.IntN(len(junk))])
	}
}

func (m *model) opKillListeners(ctx context.Context) {
	m.ops["kill-listeners"]++
	m.kills = append(m.kills, time.Now())
	m.sql(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = $1 AND datname = current_database()`, notify.ApplicationName)
}

// opForceExpiry makes a running job's lease expire on the database clock, and sometimes takes
// it back at once in the same transaction. The holder's later writes are stale: legal.
func (m *model) opForceExpiry(ctx context.Context) {
	tx, err := m.drv.Begin(ctx)
	if err != nil {
		m.fatalf("begin: %v", err)
	}
	defer tx.Rollback(ctx)
	mj, tok, ok := m.pick(ctx, tx, false, "running")
	if !ok {
		return
	}
	m.ops["force-expiry"]++
	tag, err := tx.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'
		WHERE id = $1 AND lease_token = $2 AND state = 'running'`, mj.id, tok)
	if err != nil {
		m.fatalf("force expiry: %v", err)
	}
	rescue := m.tgtRng.IntN(2) == 0
	if rescue {
		if _, err := (&leasekeeper.Rescuer{DB: tx, Interval: time.Hour}).RunOnce(ctx); err != nil {
			m.fatalf("rescue: %v", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		m.fatalf("commit forced expiry: %v", err)
	}
	if tag.RowsAffected() == 1 {
		m.mu.Lock()
		mj.forced = append(mj.forced, mforced{token: tok, rescue: rescue, at: time.Now()})
		m.mu.Unlock()
	}
}

// opShutdown stops one pool with a short grace and starts a replacement at once.
func (m *model) opShutdown() {
	if time.Since(m.lastStop) < time.Second {
		return
	}
	var live []*mpool
	for _, mp := range m.pools {
		if !mp.stopping {
			live = append(live, mp)
		}
	}
	for _, mp := range m.pools {
		if mp.stopping && len(mp.done) == 0 {
			return // one shutdown at a time
		}
	}
	if len(live) == 0 {
		return
	}
	m.ops["shutdown"]++
	mp := live[m.tgtRng.IntN(len(live))]
	grace := modelDur(m.tgtRng, 0, 400)
	mp.stopping, mp.shutdownAt, m.lastStop = true, time.Now(), time.Now()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		mp.p.Shutdown(ctx)
	}()
	m.startPool()
}

// settle waits for the pools stopping, lets the others drain every job, then stops them and
// waits for every handler to return.
func (m *model) settle(ctx context.Context) {
	for _, mp := range m.pools {
		if !mp.stopping {
			continue
		}
		select {
		case err := <-mp.done:
			mp.done <- err
		case <-time.After(30 * time.Second):
			m.fatalf("pool %s did not stop within 30s of its shutdown", mp.id)
		}
	}
	deadline := time.Now().Add(90 * time.Second)
	for m.open(ctx) > 0 {
		if time.Now().After(deadline) {
			m.dumpOpen(ctx)
			m.fatalf("jobs still not final 90s after the chaos stopped")
		}
		time.Sleep(50 * time.Millisecond) // polling the table: nothing signals "all final"
	}
	for _, mp := range m.pools {
		if !mp.stopping {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				mp.p.Shutdown(ctx)
			}()
		}
	}
	for _, mp := range m.pools {
		select {
		case err := <-mp.done:
			mp.done <- err
			if err != nil {
				m.violate(nil, "pool %s: Run returned %v", mp.id, err)
			}
		case <-time.After(30 * time.Second):
			m.fatalf("pool %s did not stop within 30s", mp.id)
		}
		m.staleSeen.Add(mp.p.Stats().StaleWrites)
	}
	wait := make(chan struct{})
	go func() { m.handlers.Wait(); close(wait) }()
	select {
	case <-wait:
	case <-time.After(30 * time.Second):
		m.fatalf("handlers still running 30s after every pool stopped")
	}
	if n := m.open(ctx); n != 0 {
		m.violate(nil, "%d jobs not final after the pools stopped", n)
	}
}

func (m *model) dumpOpen(ctx context.Context) {
	rows, err := m.drv.Query(ctx, `SELECT id, state, attempt, coalesce(lease_token, 0), coalesce(leased_by, ''),
		lease_expires_at, run_at, revoked_at IS NOT NULL FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled') ORDER BY id`)
	if err != nil {
		m.t.Logf("dump: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id, tok int64
		var state, by string
		var attempt int
		var exp *time.Time
		var runAt time.Time
		var revoked bool
		rows.Scan(&id, &state, &attempt, &tok, &by, &exp, &runAt, &revoked)
		m.t.Logf("open job %d: %s attempt %d token %d by %q expires %v run_at %v revoked %v", id, state, attempt, tok, by, exp, runAt, revoked)
		m.mu.Lock()
		mj := m.byID[id]
		m.mu.Unlock()
		if mj != nil {
			m.vmu.Lock()
			m.violJobs[mj.k] = true
			m.vmu.Unlock()
		}
	}
}

// ---- the checks ----

type mrow struct {
	id         int64
	k          *int
	state      string
	attempt    int
	max        int
	token      *int64
	revokedAt  *time.Time
	finishedAt *time.Time
	lastError  *string
	entries    []mentry
}

type mentry struct {
	at      time.Time
	attempt int
	text    string
	stack   string
	token   int64 // a rescue's entry names the token it took back
	rescue  bool
}

type mledger struct {
	jobID, token int64
	at           time.Time
}

var modelMarkerRE = regexp.MustCompile(`mk(\d+)t(\d+)\|`)

// modelRevokedNote ends the entry of a claim whose handler returned success after its revocation
// reached it; the entry begins with the revocation ("job revoked", perhaps with its reason).
const modelRevokedNote = " (the handler returned success after the revocation reached it)"

func modelIsCause(err, target error) bool { return err != nil && errors.Is(err, target) }

func modelCauseName(err error) string {
	switch {
	case err == nil:
		return "-"
	case errors.Is(err, lease.ErrRevoked):
		return "revoked"
	case errors.Is(err, lease.ErrLost):
		return "lost"
	case errors.Is(err, lease.ErrRenewalTimeout):
		return "renewal-timeout"
	case errors.Is(err, lease.ErrShutdown):
		return "shutdown"
	case errors.Is(err, pool.ErrTimeout):
		return "timeout"
	}
	return modelClip(err.Error(), 40)
}

func modelClip(s string, n int) string {
	if len(s) > n {
		return fmt.Sprintf("%q…(%d bytes)", s[:n], len(s))
	}
	return fmt.Sprintf("%q", s)
}

func (m *model) loadRows(ctx context.Context) []mrow {
	rows, err := m.drv.Query(ctx, `SELECT id, (payload->>'k')::int, state, attempt, max_attempts, lease_token,
		revoked_at, finished_at, last_error, errors::text FROM leash.jobs WHERE kind = $1 ORDER BY id`, modelKind)
	if err != nil {
		m.fatalf("read jobs: %v", err)
	}
	defer rows.Close()
	var out []mrow
	for rows.Next() {
		var r mrow
		var errs string
		if err := rows.Scan(&r.id, &r.k, &r.state, &r.attempt, &r.max, &r.token, &r.revokedAt, &r.finishedAt,
			&r.lastError, &errs); err != nil {
			m.fatalf("read jobs: %v", err)
		}
		var raw []map[string]json.RawMessage
		if err := json.Unmarshal([]byte(errs), &raw); err != nil {
			m.fatalf("job %d: errors %s: %v", r.id, modelClip(errs, 200), err)
		}
		for _, e := range raw {
			var me mentry
			var at string
			json.Unmarshal(e["at"], &at)
			json.Unmarshal(e["attempt"], &me.attempt)
			json.Unmarshal(e["error"], &me.text)
			json.Unmarshal(e["stack"], &me.stack)
			if tok, ok := e["token"]; ok {
				me.rescue = true
				json.Unmarshal(tok, &me.token)
			}
			if ts, err := time.Parse(time.RFC3339Nano, at); err == nil {
				me.at = m.local(ts)
			} else {
				m.violate(nil, "job %d: errors entry time %q: %v", r.id, at, err)
			}
			r.entries = append(r.entries, me)
		}
		if r.revokedAt != nil {
			l := m.local(*r.revokedAt)
			r.revokedAt = &l
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		m.fatalf("read jobs: %v", err)
	}
	return out
}

// check compares the final rows, the ledger and the in-memory records with the model.
func (m *model) check() {
	if m.t.Failed() {
		return
	}
	ctx := context.Background()
	rows := m.loadRows(ctx)
	lrows, err := m.drv.Query(ctx, `SELECT job_id, token, at FROM model_ledger`)
	if err != nil {
		m.fatalf("read ledger: %v", err)
	}
	ledger, err := pgx.CollectRows(lrows, func(r pgx.CollectableRow) (mledger, error) {
		var l mledger
		return l, r.Scan(&l.jobID, &l.token, &l.at)
	})
	if err != nil {
		m.fatalf("read ledger: %v", err)
	}
	effects := map[int64][]mledger{}
	for _, l := range ledger {
		effects[l.jobID] = append(effects[l.jobID], l)
	}
	seen := map[int]bool{}
	for _, r := range rows {
		if r.k == nil || *r.k < 0 || *r.k >= len(m.jobs) {
			m.violate(nil, "job %d is not one the test inserted", r.id)
			continue
		}
		mj := m.jobs[*r.k]
		seen[mj.k] = true
		if !mj.inserted || mj.id != r.id {
			m.violate(mj, "row %d exists but the model has inserted=%v id=%d", r.id, mj.inserted, mj.id)
			continue
		}
		m.checkJob(mj, r, effects[r.id])
		delete(effects, r.id)
	}
	for _, mj := range m.jobs {
		if mj.inserted && !seen[mj.k] {
			m.violate(mj, "inserted but has no row")
		}
	}
	for id := range effects {
		m.violate(nil, "ledger has effects for job %d, which has no row", id)
	}
	m.checkHostile(ctx)
}

// checkJob checks one job. The rules, with what each relies on:
//
//  1. Every job ends in exactly one final state with no lease left, at most max_attempts
//     attempts in the row (hand-backs give theirs back), and at most attempt + hand-backs
//     handler runs; no (job, token) starts twice (checked as handlers start).
//  2. Revocation: a durable revocation (revoke_job true, UPDATE that changed the row) always
//     leaves revoked_at; revoked_at is never set without some revocation of this job (stale,
//     wrong-token and forged notifications must not set it); cancelled needs revoked_at; a
//     revoked job ends cancelled or completed, never failed.
//  3. A revoked job never runs again. The claim statement skips revoked rows and the database
//     cancels revoked queued rows, so a claim can return the row after the revocation only if
//     it locked the row before the revocation's statement did: revoked_at is that statement's
//     start, so the claim's attempted_at may exceed revoked_at by at most the revocation
//     statement's own duration. The bound is therefore: the revocation op's end on our clock
//     (when revoked_at falls in a durable op's window), else revoked_at itself (a revocation
//     recorded by a worker lands on a running row, which no claim can take), plus modelEps.
//  4. Completed: the last claim returned success (or committed its effect via CompleteTx),
//     under a lease that was neither revoked nor lost when it returned, with a step that can
//     succeed; a claim whose lease had ended otherwise (timeout, shutdown) must have returned
//     within the lease plus the rescue slack, or its late success would be a renewal of an
//     ended lease. With revoked_at set, no effect may be committed (the fence orders them) and
//     the handler must have returned, or seen another end of its lease, before the revocation
//     could reach it (revoked_at + modelReach).
//  5. Failed: the last claim's own failure with its attempts used up or a permanent error, or
//     a takeover of the last attempt with attempts used up (the lease having ended or been
//     forced to expire first).
//  6. Every claim's ending is accounted for: an entry written under its token, a hand-back, a
//     takeover of its token, or (for the last claim) the completion. A claim that returned
//     success while holding its lease and did not complete the job must have been taken over.
//  7. A lease ends with ErrLost only after a takeover of that token committed (a rescue entry
//     no later than the moment the handler saw it), or after the claim's own completion
//     committed: a forged takeover notification ends nothing.
//  8. A handler that ignored its cancellation long past the end of its lease finds the row no
//     longer held under its token: ended leases are not renewed.
//  9. Errors history: every text is stored cleaned and bounded and is the handler's own (each
//     carries the claim's marker), written under a token of this job at that claim's attempt,
//     never under a token that was taken over; no "details could not be stored" fallback.
//  10. Effects: at most one per job, only for a completed job, under the completing claim's
//     token, and present whenever that claim's transaction committed.
//  11. Undisturbed jobs: a success-only script with no timeout, no revocation, no forced expiry,
//     no shutdown of its pool while it ran and no renewal trouble completes on its first
//     claim, with one run and no errors — whatever forged, stale or garbage notifications and
//     listener kills went on around it.
//  12. A revocation by NOTIFY that reached the worker holding the job (its listener connected,
//     no kill around, the claim still holding the row well after delivery) is recorded in the
//     row (DESIGN §1: "records the job cancelled … durable once it lands").
//
// checkJob checks one finished job of the model against the invariants of the state machine
// (numbered 1 to 12), each in a named check of its own.
func (m *model) checkJob(mj *mjob, r mrow, effects []mledger) {
	c := newJobCheck(m, mj, r, effects)
	c.errorEntries()
	c.finalStateAndAttempts()
	c.revocationRecorded()
	c.notClaimedAfterRevocation()
	c.notifyRevocationRecorded()
	c.lostOnlyToTakeover()
	c.endedLeasesNotRenewed()
	c.everyEndingAccounted()
	if !c.finalStateMatchesLastClaim() {
		return
	}
	c.effectsOnce()
	c.undisturbedCompleteOnce()
}

// jobCheck is what checkJob's checks share about one job: its row, its handler runs by token,
// its takeovers and the outcomes written.
type jobCheck struct {
	m       *model
	mj      *mjob
	r       mrow
	effects []mledger
	execs   []*mexec         // the job's handler runs, by token order
	byToken map[int64]*mexec // the runs by their claim's token
	// rescuedAt is when each token was taken over; wrote says which tokens wrote an errors entry.
	rescuedAt map[int64]time.Time
	wrote     map[int64]bool
	durable   []mrevoke  // revocations that must leave revoked_at
	R         *time.Time // revoked_at
	last      *mexec     // the run of the highest token
}

func (c *jobCheck) v(format string, args ...any) { c.m.violate(c.mj, format, args...) }

func newJobCheck(m *model, mj *mjob, r mrow, effects []mledger) *jobCheck {
	c := &jobCheck{m: m, mj: mj, r: r, effects: effects, byToken: map[int64]*mexec{},
		rescuedAt: map[int64]time.Time{}, wrote: map[int64]bool{}, R: r.revokedAt}
	c.execs = slices.Clone(mj.execs)
	slices.SortFunc(c.execs, func(a, b *mexec) int { return int(a.token - b.token) })
	for _, e := range c.execs {
		// The handler's goroutines are done; taking the lock orders this with their last writes.
		e.mu.Lock()
		token := e.token
		e.mu.Unlock()
		c.byToken[token] = e
	}
	for _, op := range mj.revokes {
		if op.durable {
			c.durable = append(c.durable, op)
		}
	}
	if len(c.execs) > 0 {
		c.last = c.execs[len(c.execs)-1]
	}
	return c
}

// errorEntries checks the errors history (9): each entry cleaned, bounded, said once, and the
// error of a handler of this job under a token it ran; no token both taken over and written.
func (c *jobCheck) errorEntries() {
	for i, en := range c.r.entries {
		if en.rescue {
			c.rescuedAt[en.token] = en.at
			if e := c.byToken[en.token]; e != nil && e.attempt != en.attempt {
				c.v("rescue entry #%d names attempt %d, its claim ran attempt %d", i+1, en.attempt, e.attempt)
			}
			continue
		}
		// 9: cleaned, bounded, the handler's own, under a live token of this job.
		if len(en.text) > modelMaxStoredText || len(en.stack) > modelMaxStoredText || !utf8.ValidString(en.text) ||
			strings.ContainsRune(en.text, 0) || strings.ContainsRune(en.stack, 0) {
			c.v("errors entry #%d stored uncleaned or unbounded: %d bytes %s", i+1, len(en.text), modelClip(en.text, 60))
		}
		if strings.Contains(en.text, "could not be stored") {
			c.v("errors entry #%d lost its details: %s", i+1, modelClip(en.text, 120))
		}
		// 9 (cont.): each cause is said once ("revoked: job revoked: ..." said it twice).
		for _, cause := range []string{"job revoked", "renewal timed out", "job timed out"} {
			if strings.Count(en.text, cause) > 1 {
				c.v("errors entry #%d says %q more than once: %s", i+1, cause, modelClip(en.text, 120))
			}
		}
		if strings.HasPrefix(en.text, "job revoked") && strings.HasSuffix(en.text, modelRevokedNote) {
			continue
		}
		mk := modelMarkerRE.FindStringSubmatch(en.text)
		if mk == nil {
			c.v("errors entry #%d is not a handler's error: %s", i+1, modelClip(en.text, 120))
			continue
		}
		k, _ := strconv.Atoi(mk[1])
		tok, _ := strconv.ParseInt(mk[2], 10, 64)
		e := c.byToken[tok]
		switch {
		case k != c.mj.k:
			c.v("errors entry #%d carries job k=%d's error", i+1, k)
		case e == nil:
			c.v("errors entry #%d written under token %d, which no handler of this job ran", i+1, tok)
		case e.attempt != en.attempt:
			c.v("errors entry #%d says attempt %d, its claim ran attempt %d", i+1, en.attempt, e.attempt)
		}
		c.wrote[tok] = true
	}
	for tok := range c.wrote {
		if _, ok := c.rescuedAt[tok]; ok {
			c.v("token %d both taken over and its outcome written", tok)
		}
	}
	if c.r.lastError != nil && (len(*c.r.lastError) > modelMaxStoredText || strings.ContainsRune(*c.r.lastError, 0)) {
		c.v("last_error stored uncleaned or unbounded: %d bytes", len(*c.r.lastError))
	}

}

// finalStateAndAttempts checks 1: one final state, attempts within bounds.
func (c *jobCheck) finalStateAndAttempts() {
	// 1: one final state, attempts within bounds.
	final := c.r.state == "completed" || c.r.state == "failed" || c.r.state == "cancelled"
	if !final || c.r.token != nil || c.r.finishedAt == nil {
		c.v("not final: state %s, token %v, finished_at %v", c.r.state, c.r.token, c.r.finishedAt)
	}
	if c.r.max != c.mj.max || c.r.attempt > c.r.max {
		c.v("attempt %d of max %d (model max %d)", c.r.attempt, c.r.max, c.mj.max)
	}
	handbacks := 0
	for _, e := range c.execs {
		if !e.ok() && modelIsCause(e.causeAtReturn, lease.ErrShutdown) {
			handbacks++
		}
		if e.attempt < 1 || e.attempt > c.mj.max {
			c.v("token %d ran attempt %d of max %d", e.token, e.attempt, c.mj.max)
		}
	}
	if len(c.execs) > c.r.attempt+handbacks {
		c.v("%d handler runs for %d attempts and at most %d hand-backs", len(c.execs), c.r.attempt, handbacks)
	}

}

// revocationRecorded checks 2: a durable revocation leaves revoked_at, and only a revocation does.
func (c *jobCheck) revocationRecorded() {
	// 2: revocation.
	if len(c.durable) > 0 && c.R == nil {
		c.v("a c.durable revocation (%s at %s) left no revoked_at", c.durable[0].how, c.m.rel(c.durable[0].start))
	}
	if c.R != nil && len(c.mj.revokes) == 0 {
		c.v("revoked_at set (%s) though nothing revoked it (forged %d, wrong-token %d)", c.m.rel(*c.R), len(c.mj.forged), c.mj.wrong)
	}
	if c.r.state == "cancelled" && c.R == nil {
		c.v("cancelled without revoked_at")
	}
	if c.R != nil && c.r.state == "failed" {
		c.v("revoked (at %s) but ended failed", c.m.rel(*c.R))
	}

}

// notClaimedAfterRevocation checks 3: never claimed after the revocation committed.
func (c *jobCheck) notClaimedAfterRevocation() {
	// 3: never claimed after the revocation committed.
	if c.R != nil {
		bound := *c.R
		for _, op := range c.durable {
			if !c.R.Before(op.start.Add(-modelEps)) && !c.R.After(op.end.Add(modelEps)) && op.end.After(bound) {
				bound = op.end
			}
		}
		for _, e := range c.execs {
			if e.attemptedAt.After(bound.Add(modelEps)) {
				c.v("claimed again (token %d at %s) after its revocation committed (revoked_at %s, bound %s)",
					e.token, c.m.rel(e.attemptedAt), c.m.rel(*c.R), c.m.rel(bound))
			}
		}
	}

}

// notifyRevocationRecorded checks 12: a NOTIFY revocation that reached its holder is recorded.
func (c *jobCheck) notifyRevocationRecorded() {
	// 12: a revocation by NOTIFY that reached the worker holding the job is recorded. Only
	// notifications that cannot have been lost count: sent while the holder's listener was
	// connected, with no listener kill around, naming the claim that still held the row (not
	// taken over, its handler still running, no effect committed) well after delivery.
	{
		for _, op := range c.mj.revokes {
			e := c.byToken[op.token]
			if (op.how != "notify" && op.how != "notify-token") || op.holder == nil || !op.connected || e == nil || e.effect {
				continue
			}
			delivered := op.end.Add(modelDeliver)
			at, rescued := c.rescuedAt[op.token]
			stopped := !e.pool.shutdownAt.IsZero() && e.pool.shutdownAt.Before(delivered)
			if stopped || (rescued && at.Before(delivered)) || !e.returned.After(delivered) || c.m.killedNear(op.start, delivered) {
				continue
			}
			c.m.deliveredChecked++
			if e.causeSeen != nil && e.causeAt.Before(op.start) && !modelIsCause(e.causeSeen, lease.ErrRevoked) {
				c.m.deliveredEnded++
			}
			if c.R != nil {
				continue
			}
			c.v("revocation by %s at %s reached worker %s, whose claim (token %d, lease %s since %s) held the row until after %s, "+
				"but was never recorded: the job went on (%s at attempt %d)", op.how, c.m.rel(op.start), op.holder.id, op.token,
				modelCauseName(e.causeSeen), c.m.rel(e.causeAt), c.m.rel(delivered), c.r.state, c.r.attempt)
		}
	}

}

// lostOnlyToTakeover checks 7: a lease is lost only to a real takeover.
func (c *jobCheck) lostOnlyToTakeover() {
	// 7: lost only to a real takeover (or after its own completion committed).
	for _, e := range c.execs {
		if !modelIsCause(e.causeSeen, lease.ErrLost) {
			continue
		}
		at, rescued := c.rescuedAt[e.token]
		switch {
		case rescued && !at.After(e.causeAt.Add(modelEps)):
		case e.effect && !e.commitStart.After(e.causeAt.Add(modelEps)):
		default:
			c.v("token %d lost its lease at %s without a takeover before it (takeover at %s; forged takeovers %v)",
				e.token, c.m.rel(e.causeAt), c.m.rel(at), c.mj.forged)
		}
	}
}

// endedLeasesNotRenewed checks 8: ended leases are not renewed.
func (c *jobCheck) endedLeasesNotRenewed() {
	// 8: ended leases are not renewed.
	for _, e := range c.execs {
		if e.heldChecked && e.heldAtReturn {
			c.v("token %d still held %s after its lease ended (%s): renewed after its end", e.token,
				e.heldAfter.Round(time.Millisecond), modelCauseName(e.causeSeen))
		}
	}

}

// everyEndingAccounted checks 6: every ending of a handler run left its trace.
func (c *jobCheck) everyEndingAccounted() {
	// 6: every ending accounted for.
	for _, e := range c.execs {
		if e == c.last && c.r.state == "completed" {
			continue
		}
		_, rescued := c.rescuedAt[e.token]
		handback := !e.ok() && modelIsCause(e.causeAtReturn, lease.ErrShutdown)
		lost := modelIsCause(e.causeAtReturn, lease.ErrLost) || modelIsCause(e.causeAtReturn, lease.ErrRevoked)
		if !rescued && !c.wrote[e.token] && !handback && !(e == c.last && c.r.state == "cancelled") {
			c.v("token %d's ending (%s, cause %s) left no trace: no entry, no hand-back, no takeover",
				e.token, c.m.result(e), modelCauseName(e.causeAtReturn))
		}
		if e.ok() && !lost && !rescued && !(e == c.last && c.r.state == "cancelled") {
			c.v("token %d returned success under its lease (cause %s) but neither completed the job nor was taken over",
				e.token, modelCauseName(e.causeAtReturn))
		}
	}

}

// finalStateMatchesLastClaim checks 4 and 5: the final state against the last claim. It reports
// whether the remaining checks apply (a job that ended without any handler run has no effects to check).
func (c *jobCheck) finalStateMatchesLastClaim() bool {
	// 4, 5: the final state against the c.last claim.
	switch c.r.state {
	case "completed", "failed":
		if c.last == nil {
			c.v("%s without any handler run", c.r.state)
			return false
		}
	}
	switch c.r.state {
	case "completed":
		if !c.last.ok() && !c.last.effect {
			c.v("completed, but its c.last claim (token %d) returned %s without committing an effect", c.last.token, c.m.result(c.last))
		}
		if !c.last.step.succeeds() {
			c.v("completed by step %s, which never succeeds", c.last.step)
		}
		if !c.last.effect && (modelIsCause(c.last.causeAtReturn, lease.ErrRevoked) || modelIsCause(c.last.causeAtReturn, lease.ErrLost)) {
			c.v("completed by token %d, whose lease was %s when it returned", c.last.token, modelCauseName(c.last.causeAtReturn))
		}
		if !c.last.effect && c.last.causeAtReturn != nil && c.last.returned.Sub(c.last.causeAt) > modelLease+modelExpirySlack {
			c.v("token %d's success, returned %s after its lease ended (%s), was written: the ended lease was kept",
				c.last.token, c.last.returned.Sub(c.last.causeAt).Round(time.Millisecond), modelCauseName(c.last.causeAtReturn))
		}
		if c.R != nil {
			if len(c.effects) > 0 {
				c.v("effect committed although the job was revoked (revoked_at %s)", c.m.rel(*c.R))
			}
			first := c.last.returned
			if !c.last.causeAt.IsZero() && c.last.causeAt.Before(first) {
				first = c.last.causeAt
			}
			if first.After(c.R.Add(modelReach)) {
				c.v("completed although the revocation (revoked_at %s) should have reached token %d by %s; it returned at %s",
					c.m.rel(*c.R), c.last.token, c.m.rel(c.R.Add(modelReach)), c.m.rel(c.last.returned))
			}
		}
	case "failed":
		if at, ok := c.rescuedAt[c.last.token]; ok {
			forced := false
			for _, f := range c.mj.forced {
				forced = forced || f.token == c.last.token
			}
			if c.r.attempt < c.r.max {
				c.v("failed by the takeover of attempt %d of %d", c.r.attempt, c.r.max)
			}
			if !forced && (c.last.causeSeen == nil || c.last.causeAt.After(at.Add(modelLate))) {
				c.v("token %d taken over at %s though its lease neither ended nor was forced to expire", c.last.token, c.m.rel(at))
			}
		} else {
			if !c.wrote[c.last.token] || c.last.ok() {
				c.v("failed, but not by its c.last claim's failure (token %d returned %s)", c.last.token, c.m.result(c.last))
			}
			if !c.last.step.permanent() && c.r.attempt < c.r.max {
				c.v("failed at attempt %d of %d by a step (%s) that is not permanent", c.r.attempt, c.r.max, c.last.step)
			}
			if !c.last.step.permanent() && !slices.Contains([]mact{actFail, actRetryAfter, actPanic, actHostile, actBlock,
				actBlockDeaf, actDeaf, actDeafLong, actEffectErr}, c.last.step.act) && c.last.causeSeen == nil {
				c.v("step %s failed though its context was never cancelled", c.last.step)
			}
		}
	}

	return true
}

// effectsOnce checks 10: at most one effect, the completing claim's.
func (c *jobCheck) effectsOnce() {
	// 10: c.effects.
	if len(c.effects) > 1 {
		c.v("%d c.effects committed", len(c.effects))
	}
	for _, l := range c.effects {
		switch {
		case c.r.state != "completed":
			c.v("effect (token %d) committed for a job that ended %s", l.token, c.r.state)
		case c.last == nil || l.token != c.last.token:
			c.v("effect committed under token %d, not the completing claim's", l.token)
		}
		if _, ok := c.rescuedAt[l.token]; ok {
			c.v("effect committed under token %d, which was taken over", l.token)
		}
	}
	for _, e := range c.execs {
		if e.effect && (len(c.effects) != 1 || c.effects[0].token != e.token) {
			c.v("token %d committed its effect but the ledger has %d rows", e.token, len(c.effects))
		}
	}

}

// undisturbedCompleteOnce checks 11: undisturbed jobs complete once.
func (c *jobCheck) undisturbedCompleteOnce() {
	// 11: undisturbed jobs complete once.
	if c.m.undisturbed(c.mj, c.execs) {
		if c.r.state != "completed" || c.r.attempt != 1 || len(c.execs) != 1 || len(c.r.entries) != 0 {
			c.v("undisturbed success-only job ended %s at attempt %d after %d runs with %d errors entries",
				c.r.state, c.r.attempt, len(c.execs), len(c.r.entries))
		}
		for _, e := range c.execs {
			if e.causeSeen != nil && !(e.effect && modelIsCause(e.causeSeen, lease.ErrLost)) {
				c.v("undisturbed job's token %d was cancelled: %s", e.token, modelCauseName(e.causeSeen))
			}
		}
	}
}

// killedNear reports whether listeners were killed shortly before from (the worker may not have
// noticed yet: its listener reads the termination at once, so half a second is plenty) or
// between from and to. A listener reports itself connected only once LISTEN is in effect on
// every channel, so a notification sent while it is connected and not killed is delivered.
func (m *model) killedNear(from, to time.Time) bool {
	for _, k := range m.kills {
		if k.After(from.Add(-500*time.Millisecond)) && k.Before(to) {
			return true
		}
	}
	return false
}

// undisturbed reports whether nothing legitimate could have stopped the job from completing on
// its first claim.
func (m *model) undisturbed(mj *mjob, execs []*mexec) bool {
	if !mj.successOnly() || len(mj.revokes) > 0 || len(mj.forced) > 0 {
		return false
	}
	for _, e := range execs {
		if modelIsCause(e.causeSeen, lease.ErrRenewalTimeout) {
			return false
		}
		at := e.pool.shutdownAt
		if !at.IsZero() && e.start.Before(at) && (e.returned.IsZero() || e.returned.After(at)) {
			return false
		}
	}
	return true
}

func (m *model) result(e *mexec) string {
	switch {
	case e.returned.IsZero():
		return "nothing yet"
	case e.panicked:
		return "a panic"
	case e.err != nil:
		return "error " + modelClip(e.err.Error(), 50)
	}
	return "success"
}

// report fails the test with every violation (capped), the seed, and the story of each job
// involved.
func (m *model) report() {
	states := map[string]int{}
	var runs int
	rows, err := m.drv.Query(context.Background(), `SELECT state, count(*) FROM leash.jobs GROUP BY 1`)
	if err == nil {
		for rows.Next() {
			var s string
			var n int
			rows.Scan(&s, &n)
			states[s] = n
		}
		rows.Close()
	}
	causes, steps := map[string]int{}, map[string]int{}
	held := 0
	m.mu.Lock()
	for _, mj := range m.jobs {
		runs += len(mj.execs)
		for _, e := range mj.execs {
			e.mu.Lock()
			causes[modelCauseName(e.causeSeen)]++
			steps[e.step.act.String()]++
			if e.heldChecked {
				held++
			}
			e.mu.Unlock()
		}
	}
	m.mu.Unlock()
	m.t.Logf("seed %d: %d jobs %v, %d handler runs (steps %v; lease ends %v; %d checked long after their end; "+
		"%d delivered revocations judged, %d to leases ended otherwise), %d pools, %d stale writes; ops %v",
		m.seed, len(m.jobs), states, runs, steps, causes, held, m.deliveredChecked, m.deliveredEnded, len(m.pools), m.staleSeen.Load(), m.ops)
	m.vmu.Lock()
	viol := slices.Clone(m.viol)
	m.vmu.Unlock()
	if len(viol) == 0 {
		if m.t.Failed() {
			m.dumpJobs()
		}
		return
	}
	m.t.Errorf("seed %d: %d violations of the model (replay: %s)", m.seed, len(viol), m.replay)
	for i, s := range viol {
		if i == 40 {
			m.t.Errorf("seed %d: … and %d more", m.seed, len(viol)-i)
			break
		}
		m.t.Errorf("seed %d: %s", m.seed, s)
	}
	m.dumpJobs()
}

// dumpJobs logs what the model knows of the jobs involved in violations.
func (m *model) dumpJobs() {
	m.vmu.Lock()
	which := maps.Clone(m.violJobs)
	m.vmu.Unlock()
	m.mu.Lock()
	jobs := slices.Clone(m.jobs)
	execs := make([][]*mexec, len(jobs))
	for i, mj := range jobs {
		execs[i] = slices.Clone(mj.execs)
	}
	m.mu.Unlock()
	ctx := context.Background()
	n := 0
	for i, mj := range jobs {
		if !which[mj.k] {
			continue
		}
		if n++; n > 12 {
			m.t.Logf("… more jobs not shown")
			return
		}
		var b strings.Builder
		fmt.Fprintf(&b, "seed %d job %d (k=%d) max=%d timeout=%s script=%v\n", m.seed, mj.id, mj.k, mj.max, mj.timeout, mj.script)
		for _, op := range mj.revokes {
			fmt.Fprintf(&b, "  revocation %s token=%d durable=%v %s..%s\n", op.how, op.token, op.durable, m.rel(op.start), m.rel(op.end))
		}
		for _, f := range mj.forced {
			fmt.Fprintf(&b, "  forced expiry of token %d at %s (rescued at once: %v)\n", f.token, m.rel(f.at), f.rescue)
		}
		if len(mj.forged) > 0 || mj.wrong > 0 {
			fmt.Fprintf(&b, "  forged takeovers for tokens %v; %d wrong-token revocations\n", mj.forged, mj.wrong)
		}
		var state string
		var attempt int
		var revoked, finished *time.Time
		var last *string
		var errs string
		if err := m.drv.QueryRow(ctx, `SELECT state, attempt, revoked_at, finished_at, last_error, errors::text FROM leash.jobs WHERE id = $1`,
			mj.id).Scan(&state, &attempt, &revoked, &finished, &last, &errs); err == nil {
			rel := func(t *time.Time) string {
				if t == nil {
					return "-"
				}
				return m.rel(m.local(*t))
			}
			lastErr := "-"
			if last != nil {
				lastErr = modelClip(*last, 100)
			}
			fmt.Fprintf(&b, "  row: %s attempt=%d revoked_at=%s finished_at=%s last_error=%s\n", state, attempt, rel(revoked), rel(finished), lastErr)
			fmt.Fprintf(&b, "  errors: %s\n", modelClip(errs, 600))
		}
		for _, e := range execs[i] {
			e.mu.Lock()
			fmt.Fprintf(&b, "  run token=%d attempt=%d pool=%s step=%s claimed=%s start=%s returned=%s result=%s cause=%s@%s at-return=%s effect=%v",
				e.token, e.attempt, e.pool.id, e.step, m.rel(e.attemptedAt), m.rel(e.start), m.rel(e.returned), m.result(e),
				modelCauseName(e.causeSeen), m.rel(e.causeAt), modelCauseName(e.causeAtReturn), e.effect)
			if e.heldChecked {
				fmt.Fprintf(&b, " held-at-return=%v", e.heldAtReturn)
			}
			if !e.pool.shutdownAt.IsZero() {
				fmt.Fprintf(&b, " (pool shut down at %s)", m.rel(e.pool.shutdownAt))
			}
			e.mu.Unlock()
			b.WriteString("\n")
		}
		m.t.Log(b.String())
	}
}
