package notify

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
)

// Defaults for Listener.
const (
	ReconnectDelayDefault = 2 * time.Second
	PingIntervalDefault   = 10 * time.Second
	PingTimeoutDefault    = 5 * time.Second
)

// ApplicationName is the application_name of the LISTEN connection, so that operators can find
// it in pg_stat_activity.
const ApplicationName = "leash-listener"

// Metrics counts what a Listener saw. All fields are safe for concurrent use.
type Metrics struct {
	Received   atomic.Int64 // notifications received on any channel
	Malformed  atomic.Int64 // job_revoked payloads that did not parse
	Reconnects atomic.Int64 // connections made after the first
	PingsLost  atomic.Int64 // liveness pings that did not come back in time
}

// Listener holds one LISTEN connection for job_available and job_revoked, reconnecting after
// ReconnectDelay when it breaks and forcing a reconnect when its own periodic ping does not come
// back (a half-open connection). Callbacks run on the listener's goroutine and must not block.
type Listener struct {
	// Config is the connection configuration; its DialFunc is replaced by one with TCP
	// keepalive tuned to find a dead peer in seconds. Required.
	Config *pgx.ConnConfig
	// ReconnectDelay is the wait between connection attempts. Default ReconnectDelayDefault.
	ReconnectDelay time.Duration
	// PingInterval is how often liveness is proved with a self-notification; negative disables
	// pinging. Default PingIntervalDefault.
	PingInterval time.Duration
	// PingTimeout is how long a ping may take to come back before the connection is considered
	// dead. Default PingTimeoutDefault.
	PingTimeout time.Duration
	// Notify sends a notification through another connection (the worker's pool); used for
	// pings. Pinging is off when nil.
	Notify func(ctx context.Context, channel, payload string) error
	// Logger receives connection errors and malformed payloads (rate-limited). Default: discard.
	Logger *slog.Logger
	// OnAvailable is called with the queue name of a job_available notification.
	OnAvailable func(queue string)
	// OnRevoked is called with each well-formed job_revoked payload.
	OnRevoked func(Revocation)
	// OnConnect is called after each successful connect, once LISTEN is in effect on every
	// channel: whatever was missed while disconnected can be re-checked then.
	OnConnect func()
	// Metrics, when set, is updated as notifications arrive.
	Metrics *Metrics

	connected   atomic.Bool
	connections atomic.Int64
	pingChannel string
	pong        chan string
	lastMalLog  atomic.Int64
	mu          sync.Mutex
	reconnect   context.CancelFunc
}

// Connected reports whether the listener has a live LISTEN connection.
func (l *Listener) Connected() bool { return l.connected.Load() }

// Dialer returns a net.Dialer with TCP keepalive tuned to detect a dead peer within about ten
// seconds.
func Dialer() *net.Dialer {
	return &net.Dialer{
		Timeout: 10 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3,
		},
	}
}

// Run listens until ctx is cancelled; it returns ctx's error.
func (l *Listener) Run(ctx context.Context) error {
	if l.Config == nil {
		return errors.New("notify: Listener.Config is nil")
	}
	if l.Metrics == nil {
		l.Metrics = &Metrics{}
	}
	log := l.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var nonce [8]byte
	rand.Read(nonce[:])
	l.pingChannel = "leash_ping_" + hex.EncodeToString(nonce[:])
	l.pong = make(chan string, 1)

	pl := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) { return l.connect(ctx) },
		LogError: func(ctx context.Context, err error) {
			l.connected.Store(false)
			if ctx.Err() == nil {
				log.WarnContext(ctx, "listener error", slog.Any("err", err))
			}
		},
		ReconnectDelay: cmpOr(l.ReconnectDelay, ReconnectDelayDefault),
	}
	pl.Handle(ChannelJobAvailable, pgxlisten.HandlerFunc(func(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
		l.Metrics.Received.Add(1)
		if l.OnAvailable != nil {
			l.OnAvailable(n.Payload)
		}
		return nil
	}))
	pl.Handle(ChannelJobRevoked, pgxlisten.HandlerFunc(func(ctx context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
		l.Metrics.Received.Add(1)
		r, err := ParseRevocation(n.Payload)
		if err != nil {
			l.Metrics.Malformed.Add(1)
			// At most one log line per second; the counter keeps the total.
			now := time.Now().UnixNano()
			if last := l.lastMalLog.Load(); now-last > int64(time.Second) && l.lastMalLog.CompareAndSwap(last, now) {
				log.WarnContext(ctx, "ignoring malformed job_revoked notification",
					slog.Any("err", err), slog.Int("bytes", len(n.Payload)), slog.Int64("malformed_total", l.Metrics.Malformed.Load()))
			}
			return nil
		}
		if l.OnRevoked != nil {
			l.OnRevoked(r)
		}
		return nil
	}))
	pl.Handle(l.pingChannel, pgxlisten.HandlerFunc(func(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
		select {
		case l.pong <- n.Payload:
		default:
		}
		return nil
	}))

	if l.Notify != nil && l.PingInterval >= 0 {
		go l.pingLoop(ctx, log)
	}
	for {
		sess, cancel := context.WithCancel(ctx)
		l.mu.Lock()
		l.reconnect = cancel
		l.mu.Unlock()
		pl.Listen(sess)
		cancel()
		l.connected.Store(false)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// Reconnect drops the current connection and makes a new one at once.
func (l *Listener) Reconnect() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.reconnect != nil {
		l.reconnect()
	}
}

func (l *Listener) connect(ctx context.Context) (*pgx.Conn, error) {
	cfg := l.Config.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["application_name"] = ApplicationName
	d := Dialer()
	cfg.DialFunc = d.DialContext
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	// LISTEN on everything before telling anyone we are connected, so that a re-check done in
	// OnConnect cannot miss a notification sent in between.
	for _, ch := range []string{ChannelJobAvailable, ChannelJobRevoked, l.pingChannel} {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			conn.Close(ctx)
			return nil, fmt.Errorf("listen %s: %w", ch, err)
		}
	}
	if l.connections.Add(1) > 1 {
		l.Metrics.Reconnects.Add(1)
	}
	l.connected.Store(true)
	if l.OnConnect != nil {
		l.OnConnect()
	}
	return conn, nil
}

func (l *Listener) pingLoop(ctx context.Context, log *slog.Logger) {
	interval := cmpOr(l.PingInterval, PingIntervalDefault)
	timeout := cmpOr(l.PingTimeout, PingTimeoutDefault)
	t := time.NewTicker(interval)
	defer t.Stop()
	seq := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !l.connected.Load() {
			continue
		}
		seq++
		want := fmt.Sprint(seq)
		sctx, cancel := context.WithTimeout(ctx, timeout)
		err := l.Notify(sctx, l.pingChannel, want)
		cancel()
		if err != nil {
			continue // the database is unreachable from the pool: that says nothing about the listener
		}
		if l.awaitPong(ctx, want, timeout) || ctx.Err() != nil {
			continue
		}
		l.Metrics.PingsLost.Add(1)
		log.WarnContext(ctx, "listener did not receive its own ping; reconnecting", slog.Duration("timeout", timeout))
		l.Reconnect()
	}
}

func (l *Listener) awaitPong(ctx context.Context, want string, timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case got := <-l.pong:
			if got == want {
				return true
			}
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

func cmpOr(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}
