// Package netdial tunes the TCP connections a worker makes to PostgreSQL so that a dead peer is
// found in seconds rather than minutes.
package netdial

import (
	"context"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// KeepAlive finds a dead peer within about eleven seconds of silence: 5s idle, then 3 probes 2s
// apart.
var KeepAlive = net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3}

// UserTimeout finds a dead peer while data is in flight (a statement sent to a host that died,
// where keepalive probes never start) within the same eleven seconds, on Linux (TCP_USER_TIMEOUT).
const UserTimeout = 11 * time.Second

// WithKeepAlive wraps dial (nil: a plain net.Dialer) so that a TCP connection it returns gets
// KeepAlive and UserTimeout. The DialFunc itself is kept, not replaced, because it may do what a stock dialer
// cannot (a tunnel, a custom resolver, a test proxy), and pgx's default one (which also carries
// connect_timeout) cannot be told apart from a user's. Only its result is tuned: pgx's default
// leaves Go's keepalive (about 2.5 minutes to notice), too slow for a connection that sits idle
// waiting for notifications. A connection that is not a *net.TCPConn (a Unix socket, a wrapped
// conn) is used as it is.
func WithKeepAlive(dial pgconn.DialFunc) pgconn.DialFunc {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetKeepAliveConfig(KeepAlive) // best effort: pings still find a dead peer
			setUserTimeout(tc, UserTimeout)
		}
		return c, nil
	}
}
