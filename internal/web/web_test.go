package web_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/internal/metrics"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/web"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type env struct {
	srv *httptest.Server
	p   *pool.Pool
	db  pool.DB
}

// setup runs a pool with the built-in handlers and serves the endpoints for it.
func setup(t *testing.T, token string) *env {
	t.Helper()
	db := pgtest.Pool(t)
	reg := prometheus.NewRegistry()
	p, err := pool.New(db, pool.Config{PollInterval: 50 * time.Millisecond, Observer: metrics.NewObserver(reg)})
	if err != nil {
		t.Fatal(err)
	}
	handlers.Register(p, handlers.Options{})
	metrics.RegisterPool(reg, p, db)
	go p.Run(context.Background())
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	h, err := web.New(web.Options{DB: db, ListenerConnected: p.ListenerConnected, Gatherer: reg, AdminToken: token, Refresh: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{srv: srv, p: p, db: db}
}

func get(t *testing.T, u string, header ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", u, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestEndpoints(t *testing.T) {
	t.Parallel()
	e := setup(t, "s3cret")
	if code, body := get(t, e.srv.URL+"/healthz"); code != 200 || body != "ok\n" {
		t.Fatalf("healthz %d %q", code, body)
	}
	waitFor(t, "listener", e.p.ListenerConnected)
	if code, body := get(t, e.srv.URL+"/readyz"); code != 200 {
		t.Fatalf("readyz %d %q", code, body)
	}
	code, body := get(t, e.srv.URL+"/metrics")
	for _, name := range []string{"leash_slots_busy", "leash_lease_renewals_total", "leash_leases_ended_total", "leash_revocations_total",
		"leash_stale_writes_total", "leash_notifications_received_total", "leash_notifications_malformed_total",
		"leash_listener_reconnects_total", "leash_notification_queue_usage", "leash_slots_idle 100"} {
		if code != 200 || !strings.Contains(body, name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	if code, _ := get(t, e.srv.URL+"/"); code != http.StatusUnauthorized {
		t.Fatalf("admin page without token: %d", code)
	}
	if code, body := get(t, e.srv.URL+"/", "Authorization", "Bearer s3cret"); code != 200 || !strings.Contains(body, "Jobs by queue and state") {
		t.Fatalf("admin page with token: %d", code)
	}
	// A cross-site form post is refused even with credentials.
	req, _ := http.NewRequest("POST", e.srv.URL+"/jobs/1/revoke", strings.NewReader("reason=x"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer s3cret")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	req.Header.Set("Origin", "https://evil.example")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("cross-site revoke: %d", resp.StatusCode)
	}
	if code, _ := get(t, e.srv.URL+"/jobs/999", "Authorization", "Bearer s3cret"); code != 404 {
		t.Fatalf("unknown job: %d", code)
	}
}

// The admin page end to end in headless Chromium: see a running job, click Revoke, see it
// cancelled.
func TestAdminPageInBrowser(t *testing.T) {
	t.Parallel()
	browser, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("LEASH_REQUIRE_BROWSER") != "" {
			t.Fatal("chromium not installed (install Debian's chromium package)")
		}
		t.Skip("chromium not installed; set LEASH_REQUIRE_BROWSER=1 to make this a failure")
	}
	e := setup(t, "tok")
	var id int64
	id, err = pool.Insert(context.Background(), e.db, "sleep", map[string]string{"duration": "5m"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the job to run", func() bool { return e.p.Busy() == 1 })

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true))
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancel()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancel = context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	u, _ := url.Parse(e.srv.URL)
	u.User = url.UserPassword("admin", "tok")
	row := fmt.Sprintf(`#running tr[data-job="%d"]`, id)
	step := func(a chromedp.Action[chromedp.Void]) {
		t.Helper()
		if _, err := chromedp.Run(ctx, a); err != nil {
			t.Fatalf("browser: %v", err)
		}
	}
	step(chromedp.Navigate(u.String() + "/"))
	step(chromedp.WaitVisible(row))
	running, err := chromedp.Run(ctx, chromedp.Text(row))
	if err != nil {
		t.Fatalf("browser: %v", err)
	}
	step(chromedp.Click(fmt.Sprintf("#revoke-%d", id)))
	step(chromedp.WaitVisible("#flash"))
	// The worker cancels the job within milliseconds; look at its page as a person would.
	var state string
	for i := 0; i < 100 && state != "cancelled"; i++ {
		step(chromedp.Navigate(fmt.Sprintf("%s/jobs/%d", u.String(), id)))
		if state, err = chromedp.Run(ctx, chromedp.Text("#state")); err != nil {
			t.Fatalf("browser: %v", err)
		}
		if state != "cancelled" {
			time.Sleep(100 * time.Millisecond)
		}
	}
	if !strings.Contains(running, "sleep") {
		t.Fatalf("running row %q", running)
	}
	if state != "cancelled" {
		t.Fatalf("state after revoke %q", state)
	}
}
