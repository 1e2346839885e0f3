package faults_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/faultproxy"
	"github.com/leashq/leash/internal/pgcluster"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) {
	if runWorker() {
		return
	}
	pgtest.Main(m)
}

func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
}

// harness is one scenario's world: a database (on the shared cluster, or a cluster of its own
// that the scenario may restart), worker processes each behind its own proxy, and the ledger.
type harness struct {
	t       *testing.T
	cluster *pgcluster.Cluster // set when the scenario owns it
	url     string             // direct, for the checker
	db      *pgxpool.Pool      // direct
	dir     string
	workers []*worker
}

type worker struct {
	id     string
	cmd    *exec.Cmd
	proxy  *faultproxy.Proxy
	exited chan error
	stderr *syncbuf.Buffer
}

// newHarness prepares a migrated database with a ledger. ownCluster gives the scenario a
// PostgreSQL it may stop, crash and restart.
func newHarness(t *testing.T, ownCluster bool) *harness {
	t.Helper()
	h := &harness{t: t, dir: t.TempDir()}
	if ownCluster {
		// Durable commits: the scenarios crash the server, and an asynchronous commit would lose
		// acknowledged transactions there (fsync stays off: the machine itself does not crash).
		c, err := pgcluster.Start(context.Background(), "synchronous_commit = on")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		h.cluster = c
		h.url = c.URL("postgres")
		db := h.connect()
		if _, err := pool.Migrate(context.Background(), db); err != nil {
			t.Fatal(err)
		}
		h.db = db
	} else {
		h.url = pgtest.URL(t)
		h.db = h.connect()
	}
	h.prepare()
	return h
}

// prepare creates the ledger and stops the scenario's workers when it ends.
func (h *harness) prepare() {
	t := h.t
	if _, err := h.db.Exec(context.Background(), `CREATE TABLE ledger (
		job_id bigint NOT NULL, token bigint NOT NULL, worker text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, w := range h.workers {
			w.cmd.Process.Signal(syscall.SIGCONT)
			w.cmd.Process.Kill()
			<-w.exited
			w.proxy.Close()
		}
		if t.Failed() {
			for _, w := range h.workers {
				t.Logf("worker %s stderr:\n%s", w.id, tail(w.stderr.String(), 3000))
			}
		}
	})
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func (h *harness) connect() *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(h.url)
	if err != nil {
		h.t.Fatal(err)
	}
	cfg.MaxConns = 8
	db, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(db.Close)
	return db
}

// start runs a worker process with the given number of slots, reaching PostgreSQL through its
// own proxy.
func (h *harness) start(id string, concurrency int) *worker {
	h.t.Helper()
	return h.startVia(id, concurrency, "", "")
}

// startVia is start with more hosts after the proxy in the worker's URL (host:port, comma
// separated) and more URL parameters (a=b&c=d).
func (h *harness) startVia(id string, concurrency int, moreHosts, params string) *worker {
	h.t.Helper()
	cfg, _ := pgx.ParseConfig(h.url)
	px, err := faultproxy.New(fmt.Sprintf("%s:%d", cfg.Host, cfg.Port))
	if err != nil {
		h.t.Fatal(err)
	}
	hosts := fmt.Sprintf("127.0.0.1:%d", px.Port())
	if moreHosts != "" {
		hosts += "," + moreHosts
	}
	viaProxy := fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cfg.User, hosts, cfg.Database)
	if params != "" {
		viaProxy += "&" + params
	}
	exe, _ := os.Executable()
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "FAULT_WORKER="+id, "FAULT_DB="+viaProxy,
		"FAULT_EVENTS="+filepath.Join(h.dir, "events-"+id+".jsonl"), fmt.Sprintf("FAULT_CONCURRENCY=%d", concurrency))
	w := &worker{id: id, cmd: cmd, proxy: px, exited: make(chan error, 1), stderr: &syncbuf.Buffer{}}
	cmd.Stderr = w.stderr
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	go func() { w.exited <- cmd.Wait() }()
	h.workers = append(h.workers, w)
	return w
}

func (w *worker) signal(s syscall.Signal) { w.cmd.Process.Signal(s) }

// enqueue inserts n jobs of kind with one COPY and returns how many.
func (h *harness) enqueue(n int, kind string, args any, maxAttempts int) {
	h.t.Helper()
	ps := make([]pool.InsertManyParams, n)
	for i := range ps {
		ps[i] = pool.InsertManyParams{Kind: kind, Payload: args, Opts: &pool.InsertOpts{MaxAttempts: maxAttempts}}
	}
	if _, err := pool.InsertMany(context.Background(), h.db, ps); err != nil {
		h.t.Fatal(err)
	}
}

// query runs a one-value query on the direct connection.
func (h *harness) count(sql string, args ...any) int {
	h.t.Helper()
	var n int
	if err := h.db.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		h.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// waitUntil polls the database for a condition another process brings about.
func (h *harness) waitUntil(what string, timeout time.Duration, cond func() bool) time.Duration {
	h.t.Helper()
	began := time.Now()
	for !cond() {
		if time.Since(began) > timeout {
			h.t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(25 * time.Millisecond)
	}
	return time.Since(began)
}

// drain waits until every job is final and returns how long that took.
func (h *harness) drain(timeout time.Duration) time.Duration {
	h.t.Helper()
	return h.waitUntil("every job to reach a final state", timeout, func() bool {
		return h.count(`SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled')`) == 0
	})
}

// events reads every worker's execution log.
func (h *harness) events() []event {
	h.t.Helper()
	files, _ := filepath.Glob(filepath.Join(h.dir, "events-*.jsonl"))
	var out []event
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			h.t.Fatal(err)
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			var e event
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				out = append(out, e)
			}
		}
		fh.Close()
	}
	return out
}

// ensureAndClaim creates the queues' rows, as a pool does before it claims, then claims.
func ensureAndClaim(ctx context.Context, db store.DBTX, p store.ClaimParams) ([]store.ClaimedJob, error) {
	if err := store.EnsureQueues(ctx, db, p.Queues); err != nil {
		return nil, err
	}
	return store.Claim(ctx, db.(store.Batcher), p) // a pool, a connection or a transaction
}
