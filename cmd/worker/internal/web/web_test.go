package web_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leashq/leash/cmd/worker/internal/metrics"
	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/syncbuf"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/handlers"
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
	for _, p := range []string{"/jobs", "/search?id=1"} {
		if code, _ := get(t, e.srv.URL+p); code != http.StatusUnauthorized {
			t.Fatalf("%s without the token: %d", p, code)
		}
	}
	if code, _ := get(t, e.srv.URL+"/jobs/999", "Authorization", "Bearer s3cret"); code != 404 {
		t.Fatalf("unknown job: %d", code)
	}
}

// The admin page end to end in headless Chromium: see a running job, click Revoke, see it
// cancelled.
func TestAdminPageInBrowser(t *testing.T) {
	t.Parallel()
	browserMu.Lock() // one browser at a time: two starting at once on a small machine can fail
	defer browserMu.Unlock()
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
	// Jobs finished two minutes ago, and that minute sampled, as a worker would do it.
	if _, err := e.db.Exec(context.Background(), `
		INSERT INTO leash.jobs (kind, state, attempt, created_at, run_at, attempted_at, finished_at)
		SELECT 'noop', s, 1, now() - interval '2 minutes', now() - interval '2 minutes', now() - interval '2 minutes',
		       now() - interval '2 minutes'
		FROM unnest(ARRAY['completed', 'completed', 'completed', 'failed']) s`); err != nil {
		t.Fatal(err)
	}
	if n, err := pool.SampleMinuteStats(context.Background(), e.db.(*pgxpool.Pool), pool.MinuteSampleParams{}); err != nil || n == 0 {
		t.Fatalf("sample minutes: %d, %v", n, err)
	}

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
	// The throughput chart draws the finished jobs as bars (inserted and sampled above).
	bars, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#chart-finished-svg rect.bar').length`))
	if err != nil || bars < 2 {
		t.Fatalf("throughput chart: %d bars, %v", bars, err)
	}
	desc, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('#chart-finished-svg desc').textContent`))
	if err != nil || !strings.Contains(desc, "3 completed, 1 failed") {
		t.Fatalf("throughput chart's description %q, %v", desc, err)
	}
	// Filter the job list as a person would: the running sleep job is listed, a kind that does
	// not exist lists nothing.
	step(chromedp.SetValue(`#filters input[name="kind"]`, "sleep"))
	step(chromedp.SetValue(`#filters select[name="state"]`, "running"))
	step(chromedp.Click("#filter"))
	step(chromedp.WaitVisible(fmt.Sprintf(`#jobs tr[data-job="%d"]`, id)))
	if loc, err := chromedp.Run(ctx, chromedp.Location()); err != nil || !strings.Contains(loc, "kind=sleep") || !strings.Contains(loc, "state=running") {
		t.Fatalf("filtered list at %q, %v", loc, err)
	}
	step(chromedp.SetValue(`#filters input[name="kind"]`, "no such kind"))
	step(chromedp.Click("#filter"))
	step(chromedp.WaitVisible("#no-jobs"))
	// The search goes to the job's page.
	step(chromedp.SetValue(`#search input[name="id"]`, fmt.Sprintf("#%d", id)))
	step(chromedp.Click(`#search button`))
	step(chromedp.WaitVisible("#state"))
	if loc, err := chromedp.Run(ctx, chromedp.Location()); err != nil || !strings.HasSuffix(loc, fmt.Sprintf("/jobs/%d", id)) {
		t.Fatalf("search landed at %q, %v", loc, err)
	}
	step(chromedp.Navigate(u.String() + "/"))
	step(chromedp.WaitVisible(row))
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

// serve serves the endpoints with o on a fresh database (when o.DB is nil) and no pool.
func serve(t *testing.T, o web.Options) *httptest.Server {
	t.Helper()
	if o.DB == nil {
		o.DB = pgtest.Pool(t)
	}
	h, err := web.New(o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func do(t *testing.T, req *http.Request) (int, string) {
	t.Helper()
	resp, err := http.DefaultTransport.RoundTrip(req) // no redirects followed
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if loc := resp.Header.Get("Location"); loc != "" {
		return resp.StatusCode, loc
	}
	return resp.StatusCode, string(b)
}

// With no token configured the admin page is closed unless it was opened on purpose (a
// loopback-only listener); the probes stay open.
func TestAdminPageClosedWithoutToken(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	closed := serve(t, web.Options{DB: db, Gatherer: prometheus.NewRegistry()})
	if code, body := get(t, closed.URL+"/"); code != http.StatusForbidden || !strings.Contains(body, "WORKER_ADMIN_TOKEN") {
		t.Fatalf("admin page without a token: %d %q", code, body)
	}
	for _, p := range []string{"/jobs/1", "/jobs?state=failed", "/search?id=1"} {
		if code, _ := get(t, closed.URL+p); code != http.StatusForbidden {
			t.Fatalf("%s without a token: %d", p, code)
		}
	}
	for _, p := range []string{"/healthz", "/readyz", "/metrics"} {
		if code, body := get(t, closed.URL+p); code != 200 {
			t.Fatalf("%s: %d %q", p, code, body)
		}
	}
	open := serve(t, web.Options{DB: db, AdminOpen: true})
	if code, _ := get(t, open.URL+"/"); code != 200 {
		t.Fatalf("admin page opened on purpose: %d", code)
	}
}

// A DNS-rebinding page reaches the admin page under its own name: refused. Loopback names, IP
// literals and the configured names are served; the probes answer to any name.
func TestAdminHostCheck(t *testing.T) {
	t.Parallel()
	srv := serve(t, web.Options{AdminOpen: true, AdminHosts: []string{"Worker.Internal.", ".admin.example"}})
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	cases := map[string]int{
		"evil.example": http.StatusMisdirectedRequest, "evil.example:" + port: http.StatusMisdirectedRequest,
		"localhost.evil.example": http.StatusMisdirectedRequest, "worker.internal.evil.example": http.StatusMisdirectedRequest,
		"admin.example": http.StatusMisdirectedRequest, "admin.example@127.0.0.1": http.StatusMisdirectedRequest,
		"127.0.0.1:" + port: 200, "localhost:" + port: 200, "LOCALHOST.": 200, "web.localhost": 200, "[::1]:" + port: 200,
		"10.1.2.3": 200, "worker.internal:" + port: 200, "WORKER.INTERNAL": 200, "a.admin.example": 200,
	}
	for host, want := range cases {
		req, _ := http.NewRequest("GET", srv.URL+"/", nil)
		req.Host = host
		if code, body := do(t, req); code != want {
			t.Errorf("Host %q: %d, want %d (%.80s)", host, code, want, body)
		}
	}
	req, _ := http.NewRequest("GET", srv.URL+"/healthz", nil)
	req.Host = "evil.example"
	if code, _ := do(t, req); code != 200 {
		t.Fatalf("healthz under another name: %d", code)
	}
}

// The revoke reason is stored as PostgreSQL text: NUL bytes and invalid UTF-8 become U+FFFD and a
// long reason is cut on a character boundary, never a database error.
func TestRevokeReasonIsCleaned(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	ctx := context.Background()
	long := strings.Repeat("é", 300)
	cases := map[string]string{
		"a\x00b":                  "a\uFFFDb",
		"\xff\xfe ok \xc3":        "\uFFFD ok \uFFFD",
		long:                      long,
		"  ":                      "revoked from the admin page",
		"\x00\x00":                "\uFFFD\uFFFD",
		" " + long + "\x00":       long + "\uFFFD",
		strings.Repeat("é", 1000): strings.Repeat("é", 499) + "… [1002 more bytes cut]",
	}
	for in, want := range cases {
		id, err := pool.Insert(ctx, db, "noop", nil, &pool.InsertOpts{Delay: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		form := url.Values{"reason": {in}, "back": {"index\x00"}}
		req, _ := http.NewRequest("POST", fmt.Sprintf("%s/jobs/%d/revoke?x=%%00", srv.URL, id), strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		code, loc := do(t, req)
		if code != http.StatusSeeOther || loc != fmt.Sprintf("/jobs/%d?flash=revoked", id) {
			t.Errorf("reason %q: %d %q", in, code, loc)
			continue
		}
		var got string
		db.QueryRow(ctx, `SELECT revoke_reason FROM leash.jobs WHERE id = $1`, id).Scan(&got)
		if got != want {
			t.Errorf("reason %q stored as %q, want %q", in, got, want)
		}
	}
}

// The flash message is picked by a code; text in the URL is never shown.
func TestFlashIsNotReflected(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	id, err := pool.Insert(context.Background(), db, "noop", nil, &pool.InsertOpts{Delay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	const bait = "Your session expired, log in at evil.example"
	for _, p := range []string{"/?flash=" + url.QueryEscape(bait), "/?flash=revoked&job=" + url.QueryEscape(bait),
		fmt.Sprintf("/jobs/%d?flash=%s", id, url.QueryEscape(bait))} {
		code, body := get(t, srv.URL+p)
		if code != 200 || strings.Contains(body, "evil.example") || strings.Contains(body, `id="flash"`) {
			t.Errorf("%s: %d, page shows the URL's text", p, code)
		}
	}
	if _, body := get(t, srv.URL+"/?flash=revoked&job=7"); !strings.Contains(body, "Job 7 revoked.") {
		t.Error("index flash by code not shown")
	}
	if _, body := get(t, fmt.Sprintf("%s/jobs/%d?flash=not-revocable", srv.URL, id)); !strings.Contains(body, fmt.Sprintf("Job %d is unknown or already finished", id)) {
		t.Error("job flash by code not shown")
	}
}

// /readyz is unauthenticated: it says the database is unreachable, not what the driver said
// (server names, user names, database names); the log has that.
func TestReadyzHidesDatabaseError(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/no_such_database_secret_name"
	db, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var logs syncbuf.Buffer
	srv := serve(t, web.Options{DB: db, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	code, body := get(t, srv.URL+"/readyz")
	if code != http.StatusServiceUnavailable || strings.TrimSpace(body) != "database unreachable" {
		t.Fatalf("readyz: %d %q", code, body)
	}
	if !strings.Contains(logs.String(), "no_such_database_secret_name") {
		t.Fatalf("the log lacks the detail: %q", logs.String())
	}
}
