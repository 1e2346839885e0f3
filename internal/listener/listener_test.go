package listener_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/faultproxy"
	"github.com/leashq/leash/internal/listener"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/notify"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const wait = 20 * time.Second

// recv receives from ch or fails the test after wait.
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(wait):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// waitFor polls cond, for server state that has no signal of its own.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// run runs l until the test ends.
func run(t *testing.T, l *listener.Listener) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v", err)
		}
	})
}

func notifyVia(db *pgxpool.Pool) func(context.Context, string, string) error {
	return func(ctx context.Context, channel, payload string) error {
		_, err := db.Exec(ctx, "SELECT pg_notify($1, $2)", channel, payload)
		return err
	}
}

// listenerPIDs returns the pids of this database's listener backends.
func listenerPIDs(t *testing.T, db *pgxpool.Pool) []int32 {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT pid FROM pg_stat_activity
		WHERE application_name = $1 AND datname = current_database() ORDER BY pid`, notify.ApplicationName)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// listenTracer records the LISTEN statements sent on each connection.
type listenTracer struct {
	mu      sync.Mutex
	last    *pgx.Conn
	listens map[*pgx.Conn][]string
}

func (tr *listenTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.listens == nil {
		tr.listens = map[*pgx.Conn][]string{}
	}
	tr.last = conn
	if s := strings.TrimSpace(data.SQL); strings.HasPrefix(strings.ToLower(s), "listen ") {
		tr.listens[conn] = append(tr.listens[conn], strings.Trim(s[len("listen "):], `"`))
	}
	return ctx
}

func (tr *listenTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// lastListens returns the channels LISTENed on the connection used last, sorted.
func (tr *listenTracer) lastListens() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return slices.Sorted(slices.Values(tr.listens[tr.last]))
}

// OnConnect runs once per connection, after LISTEN (sent once per channel) is in effect on every
// channel: a notification sent from OnConnect itself always arrives, on every reconnect.
func TestOnConnectAfterEveryListen(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	tr := &listenTracer{}
	cfg.Tracer = tr
	connects := make(chan []string, 1)
	avail := make(chan string, 10)
	revoked := make(chan listener.Revocation, 10)
	var n atomic.Int64
	m := &listener.Metrics{}
	l := &listener.Listener{
		Config: cfg, ReconnectDelay: 50 * time.Millisecond, PingInterval: -1,
		Notify: notifyVia(db), QueryRow: db.QueryRow, Metrics: m,
		OnAvailable: func(q string) { avail <- q },
		OnRevoked:   func(r listener.Revocation) { revoked <- r },
		OnConnect: func() {
			i := n.Add(1)
			// Sent from another connection before the listener goes on: it must not be missed.
			if _, err := db.Exec(context.Background(), "SELECT pg_notify('job_available', $1), pg_notify('job_revoked', $2)",
				fmt.Sprint("q", i), fmt.Sprint(i)); err != nil {
				t.Error(err)
			}
			connects <- tr.lastListens()
		},
	}
	run(t, l)
	const rounds = 8 // pgxlisten LISTENs in map order: a different order each time
	for i := 1; i <= rounds; i++ {
		listens := recv(t, connects, fmt.Sprintf("connect %d", i))
		if len(listens) != 4 || listens[0] != notify.ChannelJobAvailable || listens[1] != notify.ChannelJobRevoked ||
			!strings.HasPrefix(listens[2], "leash_ping_") || listens[3] != notify.ChannelQueueChanged {
			t.Fatalf("connect %d: OnConnect ran after LISTEN on %q; want each of job_available, job_revoked, queue_changed and the ping channel once", i, listens)
		}
		if !l.Connected() {
			t.Fatalf("connect %d: OnConnect ran while Connected() is false", i)
		}
		if q := recv(t, avail, "job_available"); q != fmt.Sprint("q", i) {
			t.Fatalf("connect %d: job_available %q", i, q)
		}
		if r := recv(t, revoked, "job_revoked"); r.ID != int64(i) {
			t.Fatalf("connect %d: job_revoked %+v", i, r)
		}
		if i < rounds {
			l.Reconnect()
		}
	}
	if got := m.Reconnects.Load(); got != rounds-1 {
		t.Errorf("Reconnects = %d, want %d", got, rounds-1)
	}
}

// halfOpen is a connection whose Close never reaches the server, as when the FIN is lost on a
// dead network: the server keeps the session.
type halfOpen struct {
	net.Conn
	closed atomic.Bool
}

func (c *halfOpen) Close() error {
	c.closed.Store(true)
	return nil
}

// After a lost ping on a half-open connection, the listener terminates the old server backend
// (which would keep its LISTEN and pin the notification queue) and the new connection receives
// notifications. The user's DialFunc is kept throughout.
func TestHalfOpenTerminatesOldBackend(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	px, err := faultproxy.New(fmt.Sprintf("%s:%d", cfg.Host, cfg.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(px.Close)
	var viaProxy atomic.Bool
	viaProxy.Store(true)
	var mu sync.Mutex
	var leaked []net.Conn
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range leaked {
			c.Close()
		}
	})
	var dials atomic.Int64
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		var d net.Dialer
		if !viaProxy.Load() {
			return d.DialContext(ctx, network, addr)
		}
		c, err := d.DialContext(ctx, "tcp", px.Addr())
		if err != nil {
			return nil, err
		}
		mu.Lock()
		leaked = append(leaked, c)
		mu.Unlock()
		return &halfOpen{Conn: c}, nil
	}

	connects := make(chan struct{}, 10)
	avail := make(chan string, 10)
	m := &listener.Metrics{}
	l := &listener.Listener{
		Config: cfg, ReconnectDelay: 50 * time.Millisecond,
		PingInterval: 100 * time.Millisecond, PingTimeout: time.Second,
		Notify: notifyVia(db), QueryRow: db.QueryRow, Metrics: m,
		OnAvailable: func(q string) { avail <- q },
		OnConnect:   func() { connects <- struct{}{} },
	}
	run(t, l)
	recv(t, connects, "first connect")
	pids := listenerPIDs(t, db)
	if len(pids) != 1 {
		t.Fatalf("listener backends %v, want one", pids)
	}
	old := pids[0]

	// Freeze the proxied connection: pings stop arriving and its close never reaches the server.
	viaProxy.Store(false)
	px.Hold()
	recv(t, connects, "reconnect after the lost ping")
	if m.PingsLost.Load() == 0 {
		t.Fatal("reconnected without a lost ping")
	}
	waitFor(t, "the old backend to be terminated", func() bool {
		return !slices.Contains(listenerPIDs(t, db), old) && m.Terminated.Load() == 1
	})
	if pids := listenerPIDs(t, db); len(pids) != 1 {
		t.Fatalf("listener backends %v after reconnecting, want one", pids)
	}
	if _, err := db.Exec(context.Background(), "SELECT pg_notify('job_available', 'after')"); err != nil {
		t.Fatal(err)
	}
	if q := recv(t, avail, "job_available on the new connection"); q != "after" {
		t.Fatalf("job_available %q", q)
	}
	if dials.Load() < 2 {
		t.Fatalf("the Config's DialFunc was called %d times, want every connection", dials.Load())
	}
}

// Only a backend whose pid, backend_start and application_name all match is terminated.
func TestTerminateMatchesPIDStartAndName(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	open := func(app string) (*pgx.Conn, int32, time.Time) {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.RuntimeParams["application_name"] = app
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(ctx) })
		var pid int32
		var start time.Time
		if err := c.QueryRow(ctx, `SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()`).Scan(&pid, &start); err != nil {
			t.Fatal(err)
		}
		return c, pid, start
	}
	alive := func(pid int32) bool {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	victim, pid, start := open(notify.ApplicationName)
	_, otherPID, otherStart := open("someone-else")
	m := &listener.Metrics{}
	l := &listener.Listener{QueryRow: db.QueryRow, Metrics: m}

	if l.TerminateAbandoned(ctx, pid, start.Add(time.Microsecond)) {
		t.Error("terminated a backend whose backend_start differs (a reused pid)")
	}
	if l.TerminateAbandoned(ctx, otherPID, otherStart) {
		t.Error("terminated a backend that is not a listener")
	}
	if err := victim.Ping(ctx); err != nil || !alive(otherPID) {
		t.Fatalf("a backend died: ping %v, other alive %v", err, alive(otherPID))
	}
	if !l.TerminateAbandoned(ctx, pid, start) {
		t.Fatal("did not terminate the matching backend")
	}
	waitFor(t, "the backend to exit", func() bool { return !alive(pid) })
	if !alive(otherPID) || m.Terminated.Load() != 1 {
		t.Fatalf("other alive %v, Terminated %d", alive(otherPID), m.Terminated.Load())
	}
	if l.TerminateAbandoned(ctx, pid, start) {
		t.Error("reported terminating a backend that is gone")
	}
}
