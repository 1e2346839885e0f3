package faults_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/notify"
	"github.com/leashq/leash/pool"
)

// drainBound is how long everything may take to finish after a fault heals: a lease, a poll and
// a listener reconnect, plus the work itself (given) and slack for a loaded 2-core machine.
func drainBound(work time.Duration) time.Duration {
	return leaseDuration + pollInterval + reconnectDelay + 2*work + 20*time.Second
}

func (h *harness) effects() int { return h.count(`SELECT count(*) FROM ledger`) }

// kill -9 a worker in the middle of its jobs: another worker takes them over after the lease.
func TestKill9MidJob(t *testing.T) {
	h := newHarness(t, false)
	a := h.start("A", 10)
	h.start("B", 10)
	h.enqueue(200, "ledger", ledgerArgs{MS: 300}, 20)
	h.waitUntil("work under way", 30*time.Second, func() bool { return h.effects() >= 20 })
	a.signal(syscall.SIGKILL)
	d := h.drain(drainBound(200 * 300 * time.Millisecond / 20))
	h.check(checkOpts{})
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE errors::text LIKE '%worker A stopped renewing%'`); n == 0 {
		t.Error("no job was taken over from the killed worker")
	}
	t.Logf("drained %s after kill -9; %s", d.Round(time.Millisecond), h.stats())
}

// SIGSTOP a worker past its lease, then SIGCONT: it was taken over, stays up, and writes nothing.
func TestSIGSTOPPastLease(t *testing.T) {
	h := newHarness(t, false)
	a := h.start("A", 10)
	h.start("B", 10)
	h.enqueue(100, "ledger", ledgerArgs{MS: 500}, 20)
	h.waitUntil("work under way", 30*time.Second, func() bool { return h.effects() >= 10 })
	a.signal(syscall.SIGSTOP)
	time.Sleep(2 * leaseDuration) // the fault itself: frozen past its lease
	a.signal(syscall.SIGCONT)
	h.drain(drainBound(100 * 500 * time.Millisecond / 20))
	h.check(checkOpts{frozen: true})
	select {
	case err := <-a.exited:
		t.Fatalf("worker A exited after SIGCONT: %v", err)
	default:
	}
	t.Logf("%s", h.stats())
}

// PostgreSQL restarted (fast shutdown) or crashed (every process killed) while workers claim,
// renew and complete.
func TestPostgresRestartAndCrash(t *testing.T) {
	for _, c := range []struct {
		name string
		sig  syscall.Signal
	}{{"fast-restart", syscall.SIGINT}, {"immediate", syscall.SIGQUIT}, {"crash", syscall.SIGKILL}} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, true)
			h.start("A", 20)
			h.start("B", 20)
			h.enqueue(600, "ledger", ledgerArgs{MS: 50}, 20)
			h.waitUntil("work under way", 30*time.Second, func() bool { return h.effects() >= 100 })
			h.cluster.Stop(c.sig)
			time.Sleep(time.Second) // the outage
			if err := h.cluster.Restart(context.Background()); err != nil {
				t.Fatal(err)
			}
			h.db.Reset()
			d := h.drain(drainBound(600 * 50 * time.Millisecond / 40))
			h.check(checkOpts{})
			t.Logf("drained %s after restart; %s", d.Round(time.Millisecond), h.stats())
		})
	}
}

// Network faults between one worker and the database: a cut shorter than the lease, a cut longer
// than it, a black hole (half-open connections), and one-way loss.
func TestNetworkFaults(t *testing.T) {
	short, long := ledgerArgs{MS: 400}, ledgerArgs{MS: 3000}
	for _, c := range []struct {
		name   string
		inject func(w *worker)
		length time.Duration
		jobs   int
		args   ledgerArgs
		stops  bool // the worker must stop its handlers (the fault outlasts its trust window)
	}{
		{"cut-shorter-than-lease", func(w *worker) { w.proxy.Cut() }, 600 * time.Millisecond, 150, short, false},
		{"cut-longer-than-lease", func(w *worker) { w.proxy.Cut() }, 2 * leaseDuration, 40, long, true},
		{"half-open", func(w *worker) { w.proxy.Hold() }, 2 * leaseDuration, 40, long, true},
		{"one-way-loss", func(w *worker) { w.proxy.HoldUpstream() }, 2 * leaseDuration, 40, long, true},
		{"delay", func(w *worker) { w.proxy.Delay(150 * time.Millisecond) }, 3 * time.Second, 150, short, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, false)
			a := h.start("A", 10)
			h.start("B", 10)
			h.enqueue(c.jobs, "ledger", c.args, 20)
			h.waitUntil("A to run jobs", 30*time.Second, func() bool {
				return h.count(`SELECT count(*) FROM leash.jobs WHERE leased_by = 'A'`) >= 5
			})
			c.inject(a)
			time.Sleep(c.length) // the fault itself
			a.proxy.Heal()
			d := h.drain(drainBound(time.Duration(c.jobs*c.args.MS) * time.Millisecond / 20))
			h.check(checkOpts{})
			stopped := 0
			for _, e := range h.events() {
				if e.Ev == "end" && e.Worker == "A" && strings.Contains(e.Cause, "renewal timed out") {
					stopped++
				}
			}
			if c.stops && stopped == 0 {
				t.Error("the cut-off worker did not stop any handler on its own")
			}
			t.Logf("drained %s after healing; A stopped %d handlers itself; %s", d.Round(time.Millisecond), stopped, h.stats())
		})
	}
}

// The listener's backend is terminated and revocations are sent while it is down: they land
// within about one heartbeat anyway.
func TestRevocationWhileListenerDown(t *testing.T) {
	h := newHarness(t, false)
	h.start("A", 10)
	h.enqueue(5, "ledger", ledgerArgs{MS: 60000}, 20)
	h.waitUntil("jobs running", 30*time.Second, func() bool {
		return h.count(`SELECT count(*) FROM leash.jobs WHERE state = 'running'`) == 5
	})
	ctx := context.Background()
	if _, err := h.db.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()`, notify.ApplicationName); err != nil {
		t.Fatal(err)
	}
	if _, err := h.db.Exec(ctx, `SELECT leash.revoke_job(id, 'while the listener is down') FROM leash.jobs`); err != nil {
		t.Fatal(err)
	}
	d := h.waitUntil("revocations to land", 10*time.Second, func() bool {
		return h.count(`SELECT count(*) FROM leash.jobs WHERE state = 'cancelled'`) == 5
	})
	if d > 4*heartbeat+2*time.Second {
		t.Errorf("revocations took %s with a %s heartbeat", d, heartbeat)
	}
	h.check(checkOpts{})
	t.Logf("all 5 revocations landed in %s with the listener down", d.Round(time.Millisecond))
}

// Duplicated, delayed, forged, malformed and flooded notifications on both channels.
func TestNotificationAbuse(t *testing.T) {
	h := newHarness(t, false)
	a := h.start("A", 10)
	h.start("B", 10)
	h.enqueue(300, "ledger", ledgerArgs{MS: 30}, 20)
	ctx := context.Background()
	a.proxy.Delay(100 * time.Millisecond) // A hears everything late
	var wg sync.WaitGroup
	flood := func(sql string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h.db.Exec(ctx, sql); err != nil {
				t.Errorf("%s: %v", sql, err)
			}
		}()
	}
	flood(`SELECT pg_notify('job_available', 'default') FROM generate_series(1, 1000)`) // duplicates, merged per transaction
	flood(`SELECT pg_notify('job_available', 'queue-' || i) FROM generate_series(1, 20000) i`)
	// Junk, never a bare id: a payload of digits alone is a revocation by contract.
	flood(`SELECT pg_notify('job_revoked', 'x' || left(md5(i::text), i % 40)) FROM generate_series(1, 5000) i`)
	flood(`SELECT pg_notify('job_revoked', json_build_object('id', id, 'token', 999999999 + id)::text) FROM leash.jobs`) // forged: wrong tokens
	flood(`SELECT pg_notify('job_revoked', (1000000000 + i)::text) FROM generate_series(1, 1000) i`)                     // jobs nobody holds
	flood(`SELECT pg_notify('job_revoked', '{"id":1,"token":1,"takeover":true,"x":1}') `)
	wg.Wait()
	time.Sleep(time.Second)
	a.proxy.Heal()
	h.drain(drainBound(300 * 30 * time.Millisecond / 20))
	h.check(checkOpts{})
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE state <> 'completed'`); n != 0 {
		t.Errorf("%d jobs not completed: forged or junk notifications cancelled real work", n)
	}
	t.Logf("%s", h.stats())
}

// Poison jobs: one that panics, one that crashes its process, one that never returns, one that
// ignores cancellation.
func TestPoisonJobs(t *testing.T) {
	h := newHarness(t, false)
	ctx := context.Background()
	h.enqueue(1, "panic", nil, 3)
	h.enqueue(1, "crash", nil, 2)
	h.enqueue(1, "hang", nil, 1)
	h.enqueue(1, "deaf", ledgerArgs{MS: 3000}, 1)
	h.enqueue(50, "ledger", ledgerArgs{MS: 20}, 20)
	// A supervisor restarts workers that crash, as a process manager would.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		w := h.start("A", 10)
		for n := 1; ; n++ {
			select {
			case <-stop:
				return
			case <-w.exited:
				w.exited <- nil // let cleanup reap it
				w = h.start(fmt.Sprintf("A%d", n), 10)
			}
		}
	}()
	defer func() { close(stop); wg.Wait() }()
	h.waitUntil("the slow and the hanging job to run", 30*time.Second, func() bool {
		return h.count(`SELECT count(*) FROM leash.jobs WHERE kind IN ('hang', 'deaf') AND state = 'running'`) == 2
	})
	if _, err := h.db.Exec(ctx, `SELECT leash.revoke_job(id, 'poison') FROM leash.jobs WHERE kind IN ('hang', 'deaf')`); err != nil {
		t.Fatal(err)
	}
	h.drain(60 * time.Second)
	h.check(checkOpts{})
	want := map[string]string{"panic": "failed 3", "crash": "failed 2", "hang": "cancelled 1", "deaf": "cancelled 1"}
	for kind, w := range want {
		var state string
		var attempt int
		h.db.QueryRow(ctx, `SELECT state, attempt FROM leash.jobs WHERE kind = $1`, kind).Scan(&state, &attempt)
		if got := fmt.Sprintf("%s %d", state, attempt); got != w {
			t.Errorf("%s job: %s, want %s", kind, got, w)
		}
	}
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE kind = 'ledger' AND state = 'completed'`); n != 50 {
		t.Errorf("poison stopped other work: %d of 50 completed", n)
	}
	t.Logf("%s", h.stats())
}

// Races on the same rows: two rescuers, a late completion and a late heartbeat from the old
// holder, all at once. Each job ends exactly one way.
func TestRescuerCompleteHeartbeatRace(t *testing.T) {
	h := newHarness(t, false)
	ctx := context.Background()
	const n = 300
	h.enqueue(n, "ledger", ledgerArgs{}, 20)
	claimed, err := ensureAndClaim(ctx, h.db, store.ClaimParams{Queues: []string{"default"}, Limit: n, WorkerID: "old", Lease: time.Minute})
	if err != nil || len(claimed) != n {
		t.Fatalf("claim: %d, %v", len(claimed), err)
	}
	h.db.Exec(ctx, `UPDATE leash.jobs SET lease_expires_at = now() - interval '1 second'`)
	var mu sync.Mutex
	rescued := map[int64]int{}
	var completed, renewed []int64
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				got, err := store.Rescue(ctx, h.db, 7)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, r := range got {
					rescued[r.ID]++
				}
				mu.Unlock()
			}
		}()
	}
	for i := 0; i < n; i += 10 {
		wg.Add(2)
		batch := claimed[i : i+10]
		go func() {
			defer wg.Done()
			outs := make([]store.Outcome, len(batch))
			for k, j := range batch {
				outs[k] = store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted}
			}
			ws, err := store.Finish(ctx, h.db, outs)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			for _, w := range ws {
				completed = append(completed, w.ID)
			}
			mu.Unlock()
		}()
		go func() {
			defer wg.Done()
			p := store.RenewParams{Lease: time.Minute}
			for _, j := range batch {
				p.IDs, p.Tokens = append(p.IDs, j.ID), append(p.Tokens, j.Token)
			}
			tokens, err := store.Renew(ctx, h.db, p)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			renewed = append(renewed, tokens...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	// Finish never waits on a row lock: an outcome that met a row locked by a renewal or a rescue
	// is written again while its claim holds the job, as the pool's finisher does.
	for {
		done := map[int64]bool{}
		for _, id := range completed {
			done[id] = true
		}
		var outs []store.Outcome
		var ids, tokens []int64
		for _, j := range claimed {
			if !done[j.ID] && rescued[j.ID] == 0 {
				ids, tokens = append(ids, j.ID), append(tokens, j.Token)
				outs = append(outs, store.Outcome{ID: j.ID, Token: j.Token, State: store.StateCompleted})
			}
		}
		held, err := store.StillHeld(ctx, h.db, ids, tokens)
		if err != nil {
			t.Fatal(err)
		}
		var retry []store.Outcome
		for _, o := range outs {
			if held[o.ID] {
				retry = append(retry, o)
			}
		}
		if len(retry) == 0 {
			break
		}
		ws, err := store.Finish(ctx, h.db, retry)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range ws {
			completed = append(completed, w.ID)
		}
	}
	// Whatever is left expired is rescued now.
	rest, _ := store.Rescue(ctx, h.db, n)
	for _, r := range rest {
		rescued[r.ID]++
	}
	done := map[int64]bool{}
	for _, id := range completed {
		done[id] = true
	}
	for id, k := range rescued {
		if k > 1 {
			t.Errorf("job %d rescued %d times", id, k)
		}
		if done[id] {
			t.Errorf("job %d both completed and rescued", id)
		}
	}
	if len(done)+len(rescued) != n {
		t.Errorf("%d completed + %d rescued != %d", len(done), len(rescued), n)
	}
	t.Logf("%d completed by the old holder, %d rescued, %d late heartbeats landed first", len(done), len(rescued), len(renewed))
}

// A randomized run: four worker processes with 50 slots each, random faults for a fixed time,
// then heal and drain. LEASH_SOAK=1 runs the long version.
func TestRandomizedFaults(t *testing.T) {
	faultTime := 15 * time.Second
	if os.Getenv("LEASH_SOAK") != "" {
		faultTime = 2 * time.Minute
	}
	h := newHarness(t, true)
	workers := make([]*worker, 4)
	for i := range workers {
		workers[i] = h.start(fmt.Sprintf("W%d", i), 50)
	}
	ctx := context.Background()
	h.enqueue(5000, "ledger", ledgerArgs{MS: 100}, 50)
	// A producer keeps work arriving all through the faults (through its own connection, which
	// rides out PostgreSQL restarts by retrying).
	produced := make(chan int)
	stopProducing := make(chan struct{})
	go func() {
		n := 5000
		defer func() { produced <- n }()
		batch := make([]pool.InsertManyParams, 50)
		for i := range batch {
			batch[i] = pool.InsertManyParams{Kind: "ledger", Payload: ledgerArgs{MS: 100}, Opts: &pool.InsertOpts{MaxAttempts: 50}}
		}
		for {
			select {
			case <-stopProducing:
				return
			case <-time.After(100 * time.Millisecond):
			}
			if k, err := pool.InsertMany(ctx, h.db, batch); err == nil {
				n += int(k)
			}
		}
	}()
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	t.Logf("random faults for %s (seed %d)", faultTime, seed)
	restarts := 0
	var log []string
	end := time.Now().Add(faultTime)
	for time.Now().Before(end) {
		i := rng.IntN(len(workers))
		w := workers[i]
		d := time.Duration(500+rng.IntN(2500)) * time.Millisecond
		switch f := rng.IntN(7); f {
		case 0:
			w.signal(syscall.SIGKILL)
			<-w.exited
			w.exited <- nil
			time.Sleep(d)
			restarts++
			workers[i] = h.start(fmt.Sprintf("W%d-%d", i, restarts), 50)
			log = append(log, "kill -9")
		case 1:
			w.signal(syscall.SIGSTOP)
			time.Sleep(d)
			w.signal(syscall.SIGCONT)
			log = append(log, "SIGSTOP")
		case 2:
			w.proxy.Cut()
			time.Sleep(d)
			w.proxy.Heal()
			log = append(log, "cut")
		case 3:
			w.proxy.Hold()
			time.Sleep(d)
			w.proxy.Heal()
			log = append(log, "black hole")
		case 4:
			w.proxy.HoldUpstream()
			time.Sleep(d)
			w.proxy.Heal()
			log = append(log, "one-way loss")
		case 5:
			h.cluster.Stop(syscall.SIGINT)
			time.Sleep(d / 2)
			if err := h.cluster.Restart(ctx); err != nil {
				t.Fatal(err)
			}
			h.db.Reset()
			log = append(log, "postgres restart")
		case 6:
			h.db.Exec(ctx, `SELECT pg_notify('job_revoked', md5(i::text)), pg_notify('job_available', 'x' || i) FROM generate_series(1, 2000) i`)
			log = append(log, "notification flood")
		}
	}
	close(stopProducing)
	jobs := <-produced
	for _, w := range workers {
		w.signal(syscall.SIGCONT)
		w.proxy.Heal()
	}
	backlog := h.count(`SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled')`)
	t.Logf("%d jobs enqueued, %d left when the faults healed", jobs, backlog)
	// Recovery: within a lease, a poll and a reconnect (plus slack) no lease is left expired:
	// every claim is again held by a live worker or taken back.
	r := h.waitUntil("no expired lease left", leaseDuration+pollInterval+reconnectDelay+5*time.Second, func() bool {
		return h.count(`SELECT count(*) FROM leash.jobs WHERE state = 'running' AND lease_expires_at < now()`) == 0
	})
	t.Logf("recovered %s after healing", r.Round(time.Millisecond))
	// Then the backlog drains at whatever speed this machine has.
	d := h.drain(3 * time.Minute)
	h.check(checkOpts{frozen: true})
	t.Logf("faults: %s", strings.Join(log, ", "))
	t.Logf("drained %s after healing; %s", d.Round(time.Millisecond), h.stats())
}
