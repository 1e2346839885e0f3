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
