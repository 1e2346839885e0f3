package listener_test

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/listener"
	"github.com/leashq/leash/internal/pgtest"
)

// A DialFunc in the Config is kept, and the TCP connection it returns gets the tuned keepalive.
func TestUserDialFuncKeptWithTunedKeepalive(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	var dialed atomic.Pointer[net.TCPConn]
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{KeepAlive: -1}).DialContext(ctx, network, addr)
		if tc, ok := c.(*net.TCPConn); ok {
			dialed.Store(tc)
		}
		return c, err
	}
	connects := make(chan struct{}, 1)
	l := &listener.Listener{Config: cfg, PingInterval: -1, OnConnect: func() { connects <- struct{}{} }}
	run(t, l)
	recv(t, connects, "connect")
	tc := dialed.Load()
	if tc == nil {
		t.Fatal("the Config's DialFunc was not used (or did not return a TCP connection)")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	opts := []struct {
		name       string
		level, opt int
	}{
		{"SO_KEEPALIVE", syscall.SOL_SOCKET, syscall.SO_KEEPALIVE},
		{"TCP_KEEPIDLE", syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE},
		{"TCP_KEEPINTVL", syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL},
		{"TCP_KEEPCNT", syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT},
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		for _, o := range opts {
			v, err := syscall.GetsockoptInt(int(fd), o.level, o.opt)
			if err != nil {
				serr = err
				return
			}
			got[o.name] = v
		}
	}); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	want := map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d", k, got[k], v)
		}
	}
}
