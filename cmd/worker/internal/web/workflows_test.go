package web_test

import (
	"context"
	"encoding/xml"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/pool"
)

func insertDiamond(t *testing.T, db *pgxpool.Pool, name string) pool.InsertedWorkflow {
	t.Helper()
	wf, err := pool.InsertWorkflow(context.Background(), db, name, []pool.WorkflowJob{
		{Step: "extract", Kind: "nope"}, {Step: "left", Kind: "nope", DependsOn: []string{"extract"}},
		{Step: "right", Kind: "nope", DependsOn: []string{"extract"}, MayFail: true},
		{Step: "load", Kind: "nope", DependsOn: []string{"left", "right"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return wf
}

// The workflow page draws the graph as well-formed SVG, a node per job with its state, an edge
// per dependency, names escaped; its Revoke button has the admin page's protections (token,
// same origin) and revokes the unfinished jobs.
func TestWorkflowPage(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminToken: "tok"})
	wf := insertDiamond(t, db, `<script>alert(1)</script>`)
	page := fmt.Sprintf("%s/workflows/%d", srv.URL, wf.ID)
	if code, _ := get(t, page); code != http.StatusUnauthorized && code != http.StatusForbidden {
		t.Fatalf("workflow page without the token: %d", code)
	}
	code, body := get(t, page, "Authorization", "Bearer tok")
	if code != 200 || strings.Contains(body, "<script>alert") {
		t.Fatalf("workflow page: %d %q", code, body)
	}
	svg := svgElement.FindString(body)
	if err := xml.Unmarshal([]byte(svg), new(any)); err != nil {
		t.Fatalf("graph is not well-formed: %v\n%s", err, svg)
	}
	if n := strings.Count(svg, "<rect "); n != 4 {
		t.Errorf("%d nodes drawn, want 4", n)
	}
	if n := strings.Count(svg, "<line "); n != 4 {
		t.Errorf("%d edges drawn, want 4", n)
	}
	if !strings.Contains(svg, `data-step="load" data-state="pending"`) || !strings.Contains(svg, `data-step="extract" data-state="available"`) {
		t.Errorf("states not drawn:\n%s", svg)
	}
	revoke := page + "/revoke"
	req, _ := http.NewRequest("POST", revoke, strings.NewReader(url.Values{"reason": {"x"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer tok")
	req.Header.Set("Origin", "https://evil.example")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	if code, _ := do(t, req); code != http.StatusForbidden {
		t.Fatalf("cross-origin revoke: %d", code)
	}
	req, _ = http.NewRequest("POST", revoke, strings.NewReader(url.Values{"reason": {"x"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if code, _ := do(t, req); code != http.StatusUnauthorized && code != http.StatusForbidden {
		t.Fatalf("revoke without the token: %d", code)
	}
	req, _ = http.NewRequest("POST", revoke, strings.NewReader(url.Values{"reason": {"x"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer tok")
	if code, loc := do(t, req); code != http.StatusSeeOther || !strings.Contains(loc, "n=4") {
		t.Fatalf("revoke: %d %q", code, loc)
	}
	if _, body := get(t, page+"?flash=workflow-revoked&n=<b>", "Authorization", "Bearer tok"); strings.Contains(body, "<b>") {
		t.Fatal("the flash reflects the URL")
	}
	if code, _ := get(t, srv.URL+"/workflows/999999", "Authorization", "Bearer tok"); code != http.StatusNotFound {
		t.Fatalf("unknown workflow: %d", code)
	}
}

// The workflow page in headless Chromium: the graph shows each job coloured by its state, and
// Revoke workflow cancels the unfinished ones.
func TestWorkflowPageInBrowser(t *testing.T) {
	t.Parallel()
	browserMu.Lock()
	defer browserMu.Unlock()
	browser, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("LEASH_REQUIRE_BROWSER") != "" {
			t.Fatal("chromium not installed (install Debian's chromium package)")
		}
		t.Skip("chromium not installed; set LEASH_REQUIRE_BROWSER=1 to make this a failure")
	}
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminToken: "tok", Refresh: time.Hour})
	wf := insertDiamond(t, db, "nightly")
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true))
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancel()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancel = context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	u, _ := url.Parse(srv.URL)
	u.User = url.UserPassword("admin", "tok")
	step := func(a chromedp.Action[chromedp.Void]) {
		t.Helper()
		if _, err := chromedp.Run(ctx, a); err != nil {
			t.Fatalf("browser: %v", err)
		}
	}
	step(chromedp.Navigate(fmt.Sprintf("%s/workflows/%d", u, wf.ID)))
	step(chromedp.WaitVisible("#workflow-graph"))
	fill, err := chromedp.Run(ctx, chromedp.Evaluate[string](
		`getComputedStyle(document.querySelector('#workflow-graph g[data-step="extract"] rect')).fill`))
	if err != nil || fill != "rgb(229, 231, 235)" {
		t.Fatalf("extract (available) drawn in %q, %v", fill, err)
	}
	pending, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#workflow-graph g.st-pending').length`))
	if err != nil || pending != 3 {
		t.Fatalf("%d pending nodes drawn, want 3 (%v)", pending, err)
	}
	step(chromedp.Click("#revoke-workflow"))
	step(chromedp.WaitVisible("#flash"))
	cancelled, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#workflow-graph g.st-cancelled').length`))
	if err != nil || cancelled != 4 {
		t.Fatalf("%d cancelled nodes after the revocation, want 4 (%v)", cancelled, err)
	}
	fill, err = chromedp.Run(ctx, chromedp.Evaluate[string](
		`getComputedStyle(document.querySelector('#workflow-graph g[data-step="load"] rect')).fill`))
	if err != nil || fill != "rgb(216, 180, 254)" {
		t.Fatalf("load (cancelled) drawn in %q, %v", fill, err)
	}
}

// browserMu keeps the browser tests of this package to one browser at a time.
var browserMu sync.Mutex
