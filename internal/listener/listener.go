// Package listener holds a worker's one LISTEN connection: it survives disconnects, proves
// itself alive with self-notifications, re-checks after every reconnect and terminates the
// server backend of a connection it abandoned. Payloads and channel names are package notify's.
package listener

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
	"github.com/leashq/leash/internal/netdial"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/notify"
)

// Defaults for Listener.
const (
	ReconnectDelayDefault = 2 * time.Second
	PingIntervalDefault   = 10 * time.Second
	PingTimeoutDefault    = 5 * time.Second
	// ConnectTimeoutDefault bounds each connection attempt (dial, TLS and startup) when the
	// Config sets no connect_timeout of its own.
	ConnectTimeoutDefault = 10 * time.Second
)

// terminateTimeout bounds the statement that terminates an abandoned backend.
const terminateTimeout = 10 * time.Second

// Listener holds one LISTEN connection for job_available and job_revoked, reconnecting after
// ReconnectDelay when it breaks and forcing a reconnect when its own periodic ping does not come
// back (a half-open connection). Callbacks run on the listener's goroutine and must not block.
type Listener struct {
	// Config is the connection configuration. Required. Its DialFunc (pgx's default or your own)
	// is kept; when it returns a *net.TCPConn, TCP keepalive on that connection is tuned to find
	// a dead peer in seconds (replacing whatever keepalive the DialFunc set), since the LISTEN
	// connection sits idle for hours. A Config without connect_timeout gets
	// ConnectTimeoutDefault. A server in recovery or read-only is refused while connecting
	// (store.RefuseStandby), so that a multi-host URL leads to the primary. application_name is set to notify.ApplicationName, and the session
	// settings leash pins (store.PinSession: idle_session_timeout off, since the connection is
	// idle by design and a self-notification does not count as activity, and search_path) are
	// set unless a pooler refuses them.
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
	// QueryRow runs a query through another connection (the worker's pool, e.g. pgxpool.Pool's
	// QueryRow). Before each reconnect it terminates the server backend of the connection given
	// up, if that backend still exists: after a lost ping the client closes its side only, and
	// the old backend would keep its LISTEN, pinning the server's notification queue until
	// NOTIFY fails. Only a backend whose pid, backend_start and application_name all match the
	// abandoned connection is terminated, so a reused pid is never hit. When nil, abandoned
	// backends are left to the server's own TCP keepalive.
	QueryRow func(ctx context.Context, sql string, args ...any) pgx.Row
	// Logger receives connection errors and malformed payloads (rate-limited). Default: discard.
	Logger *slog.Logger
	// OnAvailable is called with the queue name of a job_available notification.
	OnAvailable func(queue string)
	// WakeChannel, when set, is a channel of this listener's own: an insert that picked this
	// worker notifies it with a queue's name. OnWake is called with each such payload, whatever
	// it is (anyone may NOTIFY any channel).
	WakeChannel string
	OnWake      func(payload string)
	// OnRevoked is called with each well-formed job_revoked payload.
	OnRevoked func(Revocation)
	// OnQueueChanged is called with the payload of each queue_changed notification (a queue
	// name, or anything a forger sent: it only prompts a re-read of leash.queues).
	OnQueueChanged func(queue string)
	// OnConnect is called after each successful connect, once LISTEN is in effect on every
	// channel: whatever was missed while disconnected can be re-checked then.
	OnConnect func()
	// Metrics, when set, is updated as notifications arrive.
	Metrics *Metrics

	log         *slog.Logger
	connected   atomic.Bool
	downAt      atomic.Int64 // when the last connection was lost (unix nanoseconds); 0 before the first
	unpinned    atomic.Bool  // a pooler refused the pinned settings: connect without them
	connections atomic.Int64
	channels    int // channels LISTENed on each connection
	pingChannel string
	pong        chan string
	lastMalLog  atomic.Int64
	bg          sync.WaitGroup // terminations of abandoned backends

	mu        sync.Mutex
	reconnect context.CancelFunc
	gen       int64   // connections made so far
	cur       backend // the connection made last
}

// backend identifies the server process behind one LISTEN connection.
type backend struct {
	conn     *pgx.Conn
	gen      int64
	pid      int32
	start    time.Time // pg_stat_activity.backend_start; zero when QueryRow is nil
	listened int       // channels whose LISTEN is in effect
}

// Connected reports whether the listener has a live LISTEN connection.
func (l *Listener) Connected() bool { return l.connected.Load() }

// DownFor reports how long the listener has been without a live connection since it lost the
// last one (0 while connected), and whether it was ever connected.
func (l *Listener) DownFor() (time.Duration, bool) {
	at := l.downAt.Load()
	if l.connected.Load() {
		return 0, true
	}
	if at == 0 {
		return 0, l.connections.Load() > 0
	}
	return time.Since(time.Unix(0, at)), true
}

// setDown records that the current connection is no longer live.
func (l *Listener) setDown() {
	if l.connected.Swap(false) {
		l.downAt.Store(time.Now().UnixNano())
	}
}

// handler dispatches one channel's notifications and, as a pgxlisten.BacklogHandler, learns when
// pgxlisten's LISTEN on that channel is in effect.
type handler struct {
	l  *Listener
	fn func(ctx context.Context, n *pgconn.Notification)
}

func (h handler) HandleNotification(ctx context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h.fn(ctx, n)
	return nil
}

// HandleBacklog is called by pgxlisten right after its LISTEN on one channel succeeded.
func (h handler) HandleBacklog(_ context.Context, _ string, conn *pgx.Conn) error {
	h.l.listening(conn)
	return nil
}

// Run listens until ctx is cancelled; it returns ctx's error.
func (l *Listener) Run(ctx context.Context) error {
	if l.Config == nil {
		return errors.New("notify: Listener.Config is nil")
	}
	if l.Metrics == nil {
		l.Metrics = &Metrics{}
	}
	l.log = l.Logger
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	var nonce [8]byte
	rand.Read(nonce[:])
	l.pingChannel = "leash_ping_" + hex.EncodeToString(nonce[:])
	l.pong = make(chan string, 1)
	l.channels = 0
	defer l.bg.Wait()

	pl := &pgxlisten.Listener{
		Connect: func(sess context.Context) (*pgx.Conn, error) { return l.connect(ctx, sess) },
		LogError: func(ctx context.Context, err error) {
			l.setDown()
			if ctx.Err() == nil {
				l.log.WarnContext(ctx, "listener error", slog.Any("err", err))
			}
		},
		ReconnectDelay: cmp.Or(l.ReconnectDelay, ReconnectDelayDefault),
	}
	// pgxlisten issues one LISTEN per handler and calls HandleBacklog after each.
	handle := func(channel string, fn func(context.Context, *pgconn.Notification)) {
		pl.Handle(channel, handler{l: l, fn: fn})
		l.channels++
	}
	handle(notify.ChannelJobAvailable, func(_ context.Context, n *pgconn.Notification) {
		l.Metrics.Received.Add(1)
		if l.OnAvailable != nil {
			l.OnAvailable(n.Payload)
		}
	})
	handle(notify.ChannelJobRevoked, func(ctx context.Context, n *pgconn.Notification) {
		l.Metrics.Received.Add(1)
		r, err := ParseRevocation(n.Payload)
		if err != nil {
			l.Metrics.Malformed.Add(1)
			// At most one log line per second; the counter keeps the total.
			now := time.Now().UnixNano()
			if last := l.lastMalLog.Load(); now-last > int64(time.Second) && l.lastMalLog.CompareAndSwap(last, now) {
				l.log.WarnContext(ctx, "ignoring malformed job_revoked notification",
					slog.Any("err", err), slog.Int("bytes", len(n.Payload)), slog.Int64("malformed_total", l.Metrics.Malformed.Load()))
			}
			return
		}
		if l.OnRevoked != nil {
			l.OnRevoked(r)
		}
	})
	handle(notify.ChannelQueueChanged, func(_ context.Context, n *pgconn.Notification) {
		l.Metrics.Received.Add(1)
		if l.OnQueueChanged != nil {
			l.OnQueueChanged(n.Payload)
		}
	})
	if l.WakeChannel != "" {
		handle(l.WakeChannel, func(_ context.Context, n *pgconn.Notification) {
			l.Metrics.Received.Add(1)
			if l.OnWake != nil {
				l.OnWake(n.Payload)
			}
		})
	}
	handle(l.pingChannel, func(_ context.Context, n *pgconn.Notification) {
		select {
		case l.pong <- n.Payload:
		default:
		}
	})

	if l.Notify != nil && l.PingInterval >= 0 {
		l.bg.Add(1)
		go func() { defer l.bg.Done(); l.pingLoop(ctx) }()
	}
	for {
		sess, cancel := context.WithCancel(ctx)
		l.mu.Lock()
		l.reconnect = cancel
		l.mu.Unlock()
		pl.Listen(sess)
		cancel()
		l.setDown()
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

// reconnectIf reconnects when the current connection is still connection gen.
func (l *Listener) reconnectIf(gen int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur.gen == gen && l.reconnect != nil {
		l.reconnect()
	}
}

// connect opens a connection for pgxlisten, which then LISTENs on every channel. The server
// backend of the previous connection, if any, is terminated in the background first. runCtx is
// Run's context, sess the current session's.
func (l *Listener) connect(runCtx, sess context.Context) (*pgx.Conn, error) {
	l.setDown()
	l.mu.Lock()
	prev := l.cur
	l.cur = backend{}
	l.mu.Unlock()
	if prev.pid != 0 && l.QueryRow != nil {
		l.bg.Add(1)
		go func() {
			defer l.bg.Done()
			l.terminateAbandoned(runCtx, prev.pid, prev.start)
		}()
	}

	cfg := l.Config.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["application_name"] = notify.ApplicationName
	cfg.DialFunc = netdial.WithKeepAlive(cfg.DialFunc)
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = ConnectTimeoutDefault
	}
	// LISTEN on a standby fails, but on a primary fenced read-only (or a stale DNS name's replica
	// once promoted elsewhere) it succeeds and hears nothing sent on the new primary: refuse both,
	// and take the next host of the URL.
	store.RefuseStandby(&cfg.Config)
	pinned := cfg.Copy()
	store.PinSession(&pinned.Config)
	var conn *pgx.Conn
	var err error
	if !l.unpinned.Load() {
		conn, err = pgx.ConnectConfig(sess, pinned)
		if store.StartupParamsRefused(err) {
			l.unpinned.Store(true)
			l.log.WarnContext(sess, "the listener's connection goes through a pooler that refuses session settings; "+
				"listening without them (idle_session_timeout then applies): point LISTEN_DATABASE_URL at PostgreSQL itself",
				slog.Any("err", err))
		}
	}
	if l.unpinned.Load() {
		conn, err = pgx.ConnectConfig(sess, cfg)
	}
	if err != nil {
		return nil, err
	}
	b := backend{conn: conn, pid: int32(conn.PgConn().PID())}
	if l.QueryRow != nil {
		err := conn.QueryRow(sess, `SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()`).Scan(&b.start)
		if err != nil {
			conn.Close(sess)
			return nil, fmt.Errorf("read backend_start: %w", err)
		}
	}
	l.mu.Lock()
	l.gen++
	b.gen = l.gen
	l.cur = b
	l.mu.Unlock()
	return conn, nil
}

// listening records that LISTEN on one more channel is in effect on conn. After the last one the
// listener is connected and OnConnect runs: a notification sent from then on is delivered, so a
// re-check made in OnConnect cannot miss one sent while disconnected.
func (l *Listener) listening(conn *pgx.Conn) {
	l.mu.Lock()
	if l.cur.conn != conn {
		l.mu.Unlock()
		return
	}
	l.cur.listened++
	all := l.cur.listened == l.channels
	l.mu.Unlock()
	if !all {
		return
	}
	if l.connections.Add(1) > 1 {
		l.Metrics.Reconnects.Add(1)
	}
	l.connected.Store(true)
	if l.OnConnect != nil {
		l.OnConnect()
	}
}

// live returns the current connection's generation when LISTEN is in effect on all channels.
func (l *Listener) live() (int64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cur.gen, l.cur.conn != nil && l.cur.listened == l.channels
}

// terminateAbandoned terminates the listener backend pid started at start, unless it is gone
// (or its pid now belongs to another process). It reports whether a backend was terminated.
func (l *Listener) terminateAbandoned(ctx context.Context, pid int32, start time.Time) bool {
	ctx, cancel := context.WithTimeout(ctx, terminateTimeout)
	defer cancel()
	var ok bool
	err := l.QueryRow(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE pid = $1::int4 AND backend_start = $2::timestamptz AND application_name = $3::text`,
		pid, start, notify.ApplicationName).Scan(&ok)
	attrs := []any{slog.Int("pid", int(pid)), slog.Time("backend_start", start)}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		l.log.DebugContext(ctx, "previous listener backend already gone", attrs...)
	case err != nil:
		l.log.WarnContext(ctx, "could not terminate the previous listener backend; it keeps its LISTEN until the server drops it",
			append(attrs, slog.Any("err", err))...)
	case !ok:
		l.log.WarnContext(ctx, "pg_terminate_backend failed for the previous listener backend", attrs...)
	default:
		l.Metrics.Terminated.Add(1)
		l.log.InfoContext(ctx, "terminated the previous listener backend so that it does not pin the notification queue", attrs...)
		return true
	}
	return false
}

func (l *Listener) pingLoop(ctx context.Context) {
	interval := cmp.Or(l.PingInterval, PingIntervalDefault)
	timeout := cmp.Or(l.PingTimeout, PingTimeoutDefault)
	t := time.NewTicker(interval)
	defer t.Stop()
	seq := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		gen, ok := l.live()
		if !ok {
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
		l.log.WarnContext(ctx, "listener did not receive its own ping; reconnecting", slog.Duration("timeout", timeout))
		// The next connect terminates this connection's backend. If the listener has reconnected
		// meanwhile, that already happened and the new connection is left alone.
		l.reconnectIf(gen)
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
