package pool_test

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// Connect keeps the configuration's DialFunc and tunes the keepalive of the TCP connections it
// returns, so that a dead server is found in seconds.
func TestConnectTunesKeepalive(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	var dialed atomic.Pointer[net.TCPConn]
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{KeepAlive: -1}).DialContext(ctx, network, addr)
		if tc, ok := c.(*net.TCPConn); ok {
			dialed.Store(tc)
		}
		return c, err
	}
	db, err := pool.Connect(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	tc := dialed.Load()
	if tc == nil {
		t.Skip("the test server is not reached over TCP")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var idle int
	var serr error
	if err := raw.Control(func(fd uintptr) {
		idle, serr = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)
	}); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	if idle != 5 {
		t.Fatalf("TCP_KEEPIDLE = %d s, want 5", idle)
	}
}
