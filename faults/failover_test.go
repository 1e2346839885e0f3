package faults_test

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/leashq/leash/internal/faultproxy"
	"github.com/leashq/leash/internal/pgcluster"
	"github.com/leashq/leash/pool"
)

// The primary dies (kill -9, its host gone silent) under load and its streaming standby is
// promoted; the workers, given both hosts in their URL, find the new primary on their own.
//
// Fencing tokens across the switch. lease_token comes from the sequence leash.lease_tokens,
// which WAL-logs 32 values ahead of what it hands out (SEQ_LOG_VALS): a standby replaying that
// WAL holds a value up to 32 past the last token of what it replayed, and a promoted standby goes
// on from there, so a token handed out after the last replayed sequence record can come again.
// With synchronous replication no such token is ever seen: a claim's token reaches the worker only
// with the claim's acknowledged commit, whose commit record the standby flushed, and the sequence
// record precedes it in the WAL; a claim that never committed (cut off by the crash) handed its
// token to no row and no handler. So every token after the switch is above every token a handler
// saw before it, which the test checks. With asynchronous replication an acknowledged claim may
// not have reached the standby, and its token can be handed out again: the test measures it. Even
// then no stale write commits: the fence is (id, token), the old claim's row is gone from the new
// primary, and a handler cut off from it stops when its trust window ends.
//
// LEASH_FAILOVER=1 runs it (.ci/run sets it): two clusters and about a minute.
func TestFailover(t *testing.T) {
	if os.Getenv("LEASH_FAILOVER") == "" {
		t.Skip("set LEASH_FAILOVER=1 to fail a primary over to its streaming standby")
	}
	for _, sync := range []bool{true, false} {
		name := map[bool]string{true: "synchronous", false: "asynchronous"}[sync]
		t.Run(name, func(t *testing.T) { failover(t, sync) })
	}
}

func failover(t *testing.T, sync bool) {
	ctx := context.Background()
	settings := []string{"synchronous_commit = on"}
	if sync {
		settings = append(settings, "synchronous_standby_names = 'standby'")
	}
	primary, err := pgcluster.Start(ctx, settings...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	// The standby streams through a proxy, cut at the crash so that WAL still in flight is lost as
	// it would be with the host; in asynchronous mode it also lags (a delay per chunk of WAL), so
	// that the failover has acknowledged commits to undo.
	replication, err := faultproxy.New(fmt.Sprintf("127.0.0.1:%d", primary.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(replication.Close)
	if !sync {
		replication.Delay(20 * time.Millisecond)
	}
	// The standby does not inherit synchronous_standby_names: promoted, it has no standby of its
	// own, and every commit would wait for one forever (docs/operations.md, Failover).
	standby, err := pgcluster.StartStandby(ctx, primary, "standby", "synchronous_standby_names = ''",
		fmt.Sprintf("primary_conninfo = 'host=127.0.0.1 port=%d user=postgres application_name=standby'", replication.Port()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)

	h := &harness{t: t, dir: t.TempDir(), cluster: primary, url: primary.URL("postgres")}
	h.db = h.connect()
	if _, err := pool.Migrate(ctx, h.db); err != nil {
		t.Fatal(err)
	}
	h.prepare()
	if sync && h.count(`SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' AND sync_state = 'sync'`) != 1 {
		t.Fatal("the standby is not synchronous")
	}
	// A's URL asks for a read-write server, as libpq's does; B's does not, and leash's own
	// connections refuse the standby anyway.
	other := fmt.Sprintf("127.0.0.1:%d", standby.Port)
	a := h.startVia("A", 12, other, "target_session_attrs=read-write&connect_timeout=2")
	b := h.startVia("B", 12, other, "connect_timeout=2")

	const jobs = 1500
	h.enqueue(jobs, "ledger", ledgerArgs{MS: 60}, 20)
	h.waitUntil("work under way", 60*time.Second, func() bool { return h.effects() >= 300 })

	// The crash: the postmaster and its backends killed; the host's kernel resets the workers'
	// connections and refuses new ones, as after kill -9 of a primary whose machine stays up. (A
	// host that goes silent instead is found by TCP keepalive and user timeout, see netdial.)
	a.proxy.Cut()
	b.proxy.Cut()
	replication.Cut()
	primary.Stop(syscall.SIGKILL)
	killedAt := time.Now()
	time.Sleep(time.Second) // a failover manager's detection time
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	promotedAt := time.Now()
	h.url = standby.URL("postgres")
	h.db = h.connect()
	before := h.effects()

	recovered := h.waitUntil("a completion on the new primary", 60*time.Second, func() bool { return h.effects() > before })
	drained := h.drain(drainBound(jobs * 60 * time.Millisecond / 24))

	// Nothing committed is lost, nothing ends twice, no stale write commits: the suite's invariants,
	// read on the new primary. Asynchronously, an attempt whose claim was undone ran in a claim
	// the database no longer counts, as a hand-back does.
	h.check(checkOpts{handbacks: !sync})
	if n := h.count(`SELECT count(*) FROM leash.jobs`); n != jobs {
		t.Errorf("%d jobs on the new primary, %d enqueued", n, jobs)
	}

	// What the failover undid, from the workers' logs: an attempt that ended well had committed
	// its effect and completion; a job with two such attempts ran again after its completion was
	// acknowledged.
	okEnds := map[int64]int{}
	tokenJob := map[int64]int64{}
	reissued := 0
	var maxBefore, minAfter int64
	for _, e := range h.events() {
		switch e.Ev {
		case "end":
			if e.Cause == "" {
				okEnds[e.Job]++
			}
		case "start":
			if j, ok := tokenJob[e.Token]; ok && j != e.Job {
				reissued++
			}
			tokenJob[e.Token] = e.Job
			at := time.Unix(0, e.At)
			if at.Before(killedAt) && e.Token > maxBefore {
				maxBefore = e.Token
			}
			if at.After(promotedAt) && (minAfter == 0 || e.Token < minAfter) {
				minAfter = e.Token
			}
		}
	}
	rerun := 0
	for _, n := range okEnds {
		if n > 1 {
			rerun++
		}
	}
	if sync {
		if rerun > 0 {
			t.Errorf("%d completed jobs ran again after the failover", rerun)
		}
		if reissued > 0 || minAfter <= maxBefore {
			t.Errorf("fencing tokens reused: %d tokens given to two jobs; first token after the switch %d, last before %d", reissued, minAfter, maxBefore)
		}
	}
	t.Logf("%s replication: first completion on the new primary %s after promotion (%s after the kill), drained in %s; "+
		"acknowledged completions undone and run again: %d; tokens handed out again: %d (last before %d, first after %d); %s",
		map[bool]string{true: "synchronous", false: "asynchronous"}[sync], recovered.Round(10*time.Millisecond),
		(promotedAt.Sub(killedAt) + recovered).Round(10*time.Millisecond), drained.Round(10*time.Millisecond),
		rerun, reissued, maxBefore, minAfter, h.stats())
}
