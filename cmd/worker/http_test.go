package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

// inProcess runs `worker run` in this process on the test's database with env added; it stops
// when the test ends. It returns the logs and the HTTP endpoints' port (WORKER_HTTP_ADDR should
// use port 0).
func inProcess(t *testing.T, url string, kv ...string) (*syncbuf.Buffer, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncbuf.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"run"}, envOf(append([]string{"DATABASE_URL", url, "LOG_FORMAT", "json",
			"WORKER_POLL_INTERVAL", "50ms", "WORKER_SHUTDOWN_TIMEOUT", "1s"}, kv...)...), io.Discard, logs)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker: %v", err)
		}
	})
	var port string
	poll(t, 20*time.Second, "the HTTP endpoints", func() bool {
		for line := range strings.Lines(logs.String()) {
			var l struct{ Msg, Addr string }
			if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "http endpoints listening" {
				_, port, _ = net.SplitHostPort(l.Addr)
				return true
			}
		}
		select {
		case err := <-done:
			t.Fatalf("worker stopped: %v\n%s", err, logs.String())
		default:
		}
		return false
	})
	return logs, port
}

func status(t *testing.T, u, host string, header ...string) int {
	t.Helper()
	req, _ := http.NewRequest("GET", u, nil)
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// The admin page is never open to the network by omission: with no WORKER_ADMIN_TOKEN on a
// non-loopback address the worker makes a token and logs it once; on loopback it serves openly.
func TestAdminTokenByDefault(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)

	// ":port", as in the Dockerfile and docker-compose.yml: every interface.
	logs, port := inProcess(t, url, "WORKER_HTTP_ADDR", ":0")
	base := "http://127.0.0.1:" + port
	var token string
	n := 0
	for line := range strings.Lines(logs.String()) {
		var l struct {
			AdminToken string `json:"admin_token"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.AdminToken != "" {
			token = l.AdminToken
			n++
		}
	}
	if n != 1 || len(token) < 20 {
		t.Fatalf("want one generated token in the log, got %d (%q)\n%s", n, token, logs.String())
	}
	if code := status(t, base+"/", ""); code != http.StatusUnauthorized {
		t.Fatalf("admin page without the token: %d", code)
	}
	if code := status(t, base+"/", "", "Authorization", "Bearer "+token); code != 200 {
		t.Fatalf("admin page with the generated token: %d", code)
	}
	if code := status(t, base+"/healthz", ""); code != 200 {
		t.Fatalf("healthz: %d", code)
	}

	logs, port = inProcess(t, url, "WORKER_HTTP_ADDR", "127.0.0.1:0")
	if code := status(t, "http://127.0.0.1:"+port+"/", ""); code != 200 {
		t.Fatalf("admin page on loopback: %d", code)
	}
	if strings.Contains(logs.String(), "admin_token") {
		t.Fatalf("a token was made for a loopback listener:\n%s", logs.String())
	}

	logs, port = inProcess(t, url, "WORKER_HTTP_ADDR", "0.0.0.0:0", "WORKER_ADMIN_TOKEN", "configured-token", "WORKER_ADMIN_HOSTS", "worker.example, .corp.example")
	base = "http://127.0.0.1:" + port
	if code := status(t, base+"/", "", "Authorization", "Bearer configured-token"); code != 200 || strings.Contains(logs.String(), "admin_token") {
		t.Fatalf("configured token: %d\n%s", code, logs.String())
	}
	for host, want := range map[string]int{"worker.example": 200, "a.corp.example:80": 200, "evil.example": http.StatusMisdirectedRequest} {
		if code := status(t, base+"/", host, "Authorization", "Bearer configured-token"); code != want {
			t.Errorf("Host %s: %d, want %d", host, code, want)
		}
	}
}

// An http job cannot reach the worker's own endpoints (its admin page); WORKER_WEBHOOK_BLOCK_PRIVATE
// and WORKER_WEBHOOK_ALLOW reach the handler.
func TestWebhookPolicyFromEnv(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }))
	defer target.Close()
	final := func(id int64) (state, lastErr string) {
		poll(t, 20*time.Second, fmt.Sprintf("job %d to finish", id), func() bool {
			db.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM leash.jobs WHERE id = $1`, id).Scan(&state, &lastErr)
			return state == "completed" || state == "failed" || state == "retryable"
		})
		return state, lastErr
	}
	enqueue := func(u string) int64 {
		id, err := pool.Insert(ctx, db, "http", map[string]string{"url": u, "timeout": "5s"}, &pool.InsertOpts{Queue: "q"})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}

	_, port := inProcess(t, url, "WORKER_HTTP_ADDR", "127.0.0.1:0", "WORKER_QUEUES", "q")
	for _, u := range []string{"http://127.0.0.1:" + port + "/", "http://localhost:" + port + "/healthz"} {
		if state, lastErr := final(enqueue(u)); state != "failed" || !strings.Contains(lastErr, "own HTTP endpoints") {
			t.Errorf("%s: %s %q", u, state, lastErr)
		}
	}
	if state, lastErr := final(enqueue(target.URL)); state != "completed" {
		t.Errorf("another local service: %s %q", state, lastErr)
	}
}

func TestWebhookBlockPrivateFromEnv(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }))
	defer target.Close()
	for _, c := range []struct {
		queue, allow, want string
	}{{"strict", "", "failed"}, {"allowed", "10.0.0.0/8, 127.0.0.1", "completed"}} {
		inProcess(t, url, "WORKER_QUEUES", c.queue, "WORKER_WEBHOOK_BLOCK_PRIVATE", "true", "WORKER_WEBHOOK_ALLOW", c.allow,
			"WORKER_HTTP_ADDR", "127.0.0.1:0")
		id, err := pool.Insert(ctx, db, "http", map[string]string{"url": target.URL}, &pool.InsertOpts{Queue: c.queue})
		if err != nil {
			t.Fatal(err)
		}
		var state, lastErr string
		poll(t, 20*time.Second, "the job to finish", func() bool {
			db.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM leash.jobs WHERE id = $1`, id).Scan(&state, &lastErr)
			return state == "completed" || state == "failed" || state == "retryable"
		})
		if state != c.want {
			t.Errorf("%s: %s %q", c.queue, state, lastErr)
		}
	}
}
