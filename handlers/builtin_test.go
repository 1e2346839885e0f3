package handlers_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

type harness struct {
	db  *pgxpool.Pool
	evs events
}

func newHarness(t *testing.T, o handlers.Options) *harness {
	t.Helper()
	db := pgtest.Pool(t)
	h := &harness{db: db, evs: make(events, 100)}
	p, err := pool.New(db, pool.Config{PollInterval: 50 * time.Millisecond, Observer: h.evs,
		LeaseDuration: 2 * time.Second, HeartbeatInterval: 500 * time.Millisecond,
		RetryBackoff: func(int) time.Duration { return time.Hour }})
	if err != nil {
		t.Fatal(err)
	}
	if err := handlers.Register(p, o); err != nil {
		t.Fatal(err)
	}
	go p.Run(context.Background())
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	return h
}

func (h *harness) run(t *testing.T, kind, payload string) (id int64, state, lastErr string) {
	t.Helper()
	id, err := pool.Insert(context.Background(), h.db, kind, []byte(payload), nil)
	if err != nil {
		t.Fatal(err)
	}
	h.wait(t)
	state, lastErr = h.state(id)
	return id, state, lastErr
}

func (h *harness) wait(t *testing.T) {
	t.Helper()
	select {
	case <-h.evs:
	case <-time.After(20 * time.Second):
		t.Fatal("job did not finish")
	}
}

func (h *harness) state(id int64) (string, string) {
	var state, lastErr string
	h.db.QueryRow(context.Background(), "SELECT state, coalesce(last_error, '') FROM leash.jobs WHERE id = $1", id).Scan(&state, &lastErr)
	return state, lastErr
}

func TestHTTPHandler(t *testing.T) {
	t.Parallel()
	type seen struct {
		method, ctype, body string
		header              http.Header
	}
	got := make(chan seen, 10)
	blocked := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.Method, r.Header.Get("Content-Type"), string(b), r.Header}
		switch r.URL.Path {
		case "/ok":
			w.WriteHeader(204)
		case "/missing":
			http.Error(w, "no such thing here", 404)
		case "/busy":
			w.Header().Set("Retry-After", "120")
			w.WriteHeader(429)
		case "/broken":
			http.Error(w, "oops", 500)
		case "/slow":
			blocked <- struct{}{}
			<-r.Context().Done()
		}
	}))
	defer srv.Close()
	h := newHarness(t, handlers.Options{})

	id, state, _ := h.run(t, "http", fmt.Sprintf(`{"url":%q,"body":{"a":1},"headers":{"X-Test":"yes"}}`, srv.URL+"/ok"))
	s := <-got
	if state != "completed" || s.method != "POST" || s.ctype != "application/json" || s.body != `{"a": 1}` || s.header.Get("X-Test") != "yes" {
		t.Fatalf("ok: %s %+v", state, s)
	}
	if s.header.Get("Leash-Job-Id") != strconv.FormatInt(id, 10) || s.header.Get("Leash-Attempt") != "1" ||
		s.header.Get("Leash-Lease-Token") == "" || s.header.Get("Idempotency-Key") != fmt.Sprintf("leash-job-%d", id) {
		t.Fatalf("headers %v", s.header)
	}

	_, state, lastErr := h.run(t, "http", fmt.Sprintf(`{"url":%q,"method":"put","body":"plain text"}`, srv.URL+"/missing"))
	s = <-got
	if state != "failed" || !strings.Contains(lastErr, "404") || !strings.Contains(lastErr, "no such thing") || s.method != "PUT" || s.body != "plain text" {
		t.Fatalf("404: %s %q %+v", state, lastErr, s)
	}

	id, state, lastErr = h.run(t, "http", fmt.Sprintf(`{"url":%q}`, srv.URL+"/busy"))
	<-got
	var wait float64
	h.db.QueryRow(context.Background(), "SELECT extract(epoch FROM run_at - now()) FROM leash.jobs WHERE id = $1", id).Scan(&wait)
	if state != "retryable" || !strings.Contains(lastErr, "429") || wait < 100 || wait > 121 {
		t.Fatalf("429: %s %q, retry in %.0fs", state, lastErr, wait)
	}

	_, state, lastErr = h.run(t, "http", fmt.Sprintf(`{"url":%q}`, srv.URL+"/broken"))
	<-got
	if state != "retryable" || !strings.Contains(lastErr, "500") {
		t.Fatalf("500: %s %q", state, lastErr)
	}

	_, state, lastErr = h.run(t, "http", `{"url":"ftp://example.com/x"}`)
	if state != "failed" || !strings.Contains(lastErr, "http or https") {
		t.Fatalf("bad url: %s %q", state, lastErr)
	}

	// Revocation aborts the request.
	id, err := pool.Insert(context.Background(), h.db, "http", []byte(fmt.Sprintf(`{"url":%q}`, srv.URL+"/slow")), nil)
	if err != nil {
		t.Fatal(err)
	}
	<-blocked
	<-got
	h.db.Exec(context.Background(), "SELECT leash.revoke_job($1, 'abort')", id)
	h.wait(t)
	if state, lastErr := h.state(id); state != "cancelled" {
		t.Fatalf("revoked webhook: %s %q", state, lastErr)
	}
}

func TestExecHandler(t *testing.T) {
	t.Parallel()
	sh, err := filepathAbs("/bin/sh")
	if err != nil {
		t.Skip("no /bin/sh")
	}
	disabled := newHarness(t, handlers.Options{})
	if _, state, lastErr := disabled.run(t, "exec", `{"cmd":["/bin/true"]}`); state != "failed" || !strings.Contains(lastErr, "WORKER_EXEC_ALLOW") {
		t.Fatalf("disabled: %s %q", state, lastErr)
	}

	h := newHarness(t, handlers.Options{ExecAllow: []string{sh}, ExecGrace: 200 * time.Millisecond, ExecEnvAllow: []string{"X"}})
	if _, state, lastErr := h.run(t, "exec", `{"cmd":["/bin/true"]}`); state != "failed" || !strings.Contains(lastErr, "not in WORKER_EXEC_ALLOW") {
		t.Fatalf("not allowed: %s %q", state, lastErr)
	}
	id, state, lastErr := h.run(t, "exec", `{"cmd":["/bin/sh","-c","echo job=$LEASH_JOB_ID attempt=$LEASH_ATTEMPT x=$X db=$DATABASE_URL; exit 3"],"env":{"X":"y"}}`)
	want := fmt.Sprintf("exit code 3: job=%d attempt=1 x=y db=", id)
	if state != "retryable" || !strings.Contains(lastErr, want) {
		t.Fatalf("exit 3: %s %q, want %q", state, lastErr, want)
	}
	if _, state, lastErr := h.run(t, "exec", `{"cmd":["/bin/sh","-c","exit 0"]}`); state != "completed" {
		t.Fatalf("exit 0: %s %q", state, lastErr)
	}

	// Revocation: the command ignores SIGTERM and has a grandchild; both must be gone.
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "grandchild")
	script := fmt.Sprintf(`trap '' TERM; sleep 300 & echo $! > %s.tmp; mv %s.tmp %s; wait`, pidFile, pidFile, pidFile)
	id, err = pool.Insert(context.Background(), h.db, "exec", []byte(fmt.Sprintf(`{"cmd":["/bin/sh","-c",%q]}`, script)), nil)
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	deadline := time.Now().Add(20 * time.Second)
	for {
		if b, err := os.ReadFile(pidFile); err == nil {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("command did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	h.db.Exec(context.Background(), "SELECT leash.revoke_job($1)", id)
	h.wait(t)
	if state, lastErr := h.state(id); state != "cancelled" {
		t.Fatalf("revoked command: %s %q", state, lastErr)
	}
	deadline = time.Now().Add(5 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("grandchild %d survived the revocation", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func filepathAbs(p string) (string, error) {
	if _, err := os.Stat(p); err != nil {
		return "", err
	}
	return filepath.Abs(p)
}
