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
