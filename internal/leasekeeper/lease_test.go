package leasekeeper

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

func TestTrustWindow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		k := NewKeeper(nil, Config{Duration: 2 * time.Second, HeartbeatInterval: 500 * time.Millisecond}, nil, nil, nil)
		ctx, l := k.Hold(context.Background(), 1, 7, time.Now()) // trusted for 2s - 400ms
		time.Sleep(1500 * time.Millisecond)
		if err := l.EnsureActive(); err != nil {
			t.Fatalf("at 1.5s: %v", err)
		}
		l.confirm(time.Now()) // renewal sent at 1.5s, confirmed
		time.Sleep(1500 * time.Millisecond)
		if err := l.EnsureActive(); err != nil || ctx.Err() != nil {
			t.Fatalf("at 3.0s: %v", err)
		}
		time.Sleep(200 * time.Millisecond) // past 1.5s + 1.6s
		synctest.Wait()
		if !errors.Is(context.Cause(ctx), ErrRenewalTimeout) || !errors.Is(l.EnsureActive(), ErrRenewalTimeout) {
			t.Fatalf("at 3.2s: cause %v", context.Cause(ctx))
		}
		// A late confirmation does not revive an ended lease.
		l.confirm(time.Now())
		if !errors.Is(l.EnsureActive(), ErrRenewalTimeout) {
			t.Fatal("lease revived")
		}
		if k.metrics.EndedTimeout.Load() != 1 {
			t.Fatal("timeout not counted")
		}
	})
}

func TestConfirmOfOldSendDoesNotExtendPastTrust(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		k := NewKeeper(nil, Config{Duration: 2 * time.Second, HeartbeatInterval: 500 * time.Millisecond}, nil, nil, nil)
		sent := time.Now()
		_, l := k.Hold(context.Background(), 1, 7, sent)
		// A renewal sent at 0 whose answer arrives at 1.7s (a stalled process): the window counts
		// from the send, so the lease is already untrusted.
		time.Sleep(1700 * time.Millisecond)
		l.confirm(sent)
		if !errors.Is(l.EnsureActive(), ErrRenewalTimeout) {
			t.Fatalf("trusted past send + window: %v", l.EnsureActive())
		}
	})
}

func TestFirstCauseWins(t *testing.T) {
	k := NewKeeper(nil, Config{}, nil, nil, nil)
	ctx, l := k.Hold(context.Background(), 1, 1, time.Now())
	if !l.End(ErrRevoked) || l.End(ErrLost) {
		t.Fatal("End did not report the first cause only")
	}
	if !errors.Is(context.Cause(ctx), ErrRevoked) || !errors.Is(l.Cause(), ErrRevoked) {
		t.Fatalf("cause %v", context.Cause(ctx))
	}
	if l.MarkFinishing() != true || l.MarkFinishing() != false {
		t.Fatal("MarkFinishing did not report the first call only")
	}
	k.Release(l)
}

// The leases of one claim share a trust watch: each still ends when its own trust window passes,
// one renewed later than the others, one released before, one held late with the claim's
// passed deadline (at once).
func TestLeasesOfOneClaimEndEachAtItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		k := NewKeeper(nil, Config{Duration: 2 * time.Second, HeartbeatInterval: 500 * time.Millisecond}, nil, nil, nil)
		sent := time.Now() // trusted until 1.6s unless renewed
		ctxA, _ := k.Hold(context.Background(), 1, 1, sent)
		ctxB, b := k.Hold(context.Background(), 2, 2, sent)
		ctxC, c := k.Hold(context.Background(), 3, 3, sent)
		time.Sleep(time.Second)
		k.Release(c)
		time.Sleep(500 * time.Millisecond)
		b.confirm(time.Now()) // renewed at 1.5s: trusted until 3.1s
		time.Sleep(200 * time.Millisecond)
		synctest.Wait()
		if !errors.Is(context.Cause(ctxA), ErrRenewalTimeout) {
			t.Fatalf("at 1.7s, the lease not renewed: cause %v", context.Cause(ctxA))
		}
		if ctxB.Err() != nil {
			t.Fatalf("at 1.7s, the renewed lease: cause %v", context.Cause(ctxB))
		}
		if c.Cause() != nil || context.Cause(ctxC) != context.Canceled {
			t.Fatalf("the released lease: cause %v, context %v", c.Cause(), context.Cause(ctxC))
		}
		// A lease of the same claim held only now is past its trust already: it ends at once, not
		// when the renewed one's trust runs out.
		ctxD, _ := k.Hold(context.Background(), 4, 4, sent)
		synctest.Wait()
		if !errors.Is(context.Cause(ctxD), ErrRenewalTimeout) {
			t.Fatalf("the lease held past its trust: cause %v", context.Cause(ctxD))
		}
		time.Sleep(1500 * time.Millisecond) // 3.2s
		synctest.Wait()
		if !errors.Is(context.Cause(ctxB), ErrRenewalTimeout) {
			t.Fatalf("at 3.2s, the renewed lease: cause %v", context.Cause(ctxB))
		}
		if n := k.metrics.EndedTimeout.Load(); n != 3 {
			t.Fatalf("%d timeouts counted; want 3", n)
		}
	})
}

// A claim's shared trust watch under the orders a hostile scheduler picks: a renewal whose
// confirmation comes after the claim's deadline revives nothing (the leases ended at their
// deadline); a renewal confirming one lease of two moves only that one's deadline; releasing
// every lease of a claim stops its timer; a lease held after that, with the claim's passed
// deadline, ends at once under a watch of its own.
func TestTrustWatchHostileOrders(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		k := NewKeeper(nil, Config{Duration: 2 * time.Second, HeartbeatInterval: 500 * time.Millisecond}, nil, nil, nil)
		sent := time.Now() // trusted until 1.6s
		ctxA, a := k.Hold(context.Background(), 1, 1, sent)
		ctxB, b := k.Hold(context.Background(), 2, 2, sent)
		w := a.watch
		if b.watch != w {
			t.Fatal("the leases of one claim are under two watches")
		}
		time.Sleep(time.Second)
		renewalSent := time.Now() // 1.0s: would trust until 2.6s
		time.Sleep(700 * time.Millisecond)
		synctest.Wait()
		a.confirm(renewalSent) // confirmed at 1.7s, after the 1.6s deadline
		b.confirm(renewalSent)
		if !errors.Is(context.Cause(ctxA), ErrRenewalTimeout) || !errors.Is(context.Cause(ctxB), ErrRenewalTimeout) {
			t.Fatalf("a renewal confirmed past the deadline: causes %v, %v", context.Cause(ctxA), context.Cause(ctxB))
		}
		k.Release(a)
		k.Release(b)

		sent = time.Now() // 1.7s: trusted until 3.3s
		ctxC, c := k.Hold(context.Background(), 3, 3, sent)
		ctxD, d := k.Hold(context.Background(), 4, 4, sent)
		time.Sleep(time.Second)
		c.confirm(time.Now())              // 2.7s: c trusted until 4.3s, d still until 3.3s
		time.Sleep(700 * time.Millisecond) // 3.4s
		synctest.Wait()
		if ctxC.Err() != nil || !errors.Is(context.Cause(ctxD), ErrRenewalTimeout) {
			t.Fatalf("at 3.4s: the renewed lease %v, the other %v", context.Cause(ctxC), context.Cause(ctxD))
		}
		k.Release(d)
		k.Release(c) // the last of its claim: the watch's timer stops
		cw := c.watch
		cw.mu.Lock()
		closed := cw.closed
		stopped := !cw.timer.Stop()
		cw.mu.Unlock()
		if !closed || !stopped {
			t.Fatalf("every lease of the claim released: watch closed %v, timer stopped %v", closed, stopped)
		}
		ctxE, e := k.Hold(context.Background(), 5, 5, sent) // held late, past 3.3s
		synctest.Wait()
		if e.watch == cw || !errors.Is(context.Cause(ctxE), ErrRenewalTimeout) {
			t.Fatalf("a lease held after its claim's watch closed: same watch %v, cause %v", e.watch == cw, context.Cause(ctxE))
		}
		if n := k.metrics.EndedTimeout.Load(); n != 4 {
			t.Fatalf("%d timeouts counted; want 4", n)
		}
	})
}
