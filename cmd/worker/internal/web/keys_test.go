package web_test

import (
	"context"
	"html"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/pool"
)

// The queue list shows each queue's limits and links its page; the queue page lists the keys at
// their per-key limit and the busiest keys with their holders and waiting jobs, every key escaped
// and a long one shortened on a character boundary.
func TestQueuePageKeys(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	ctx := context.Background()
	const q = "kq/a b"
	if err := pool.SetQueueMaxRunningPerKey(ctx, db, q, 1); err != nil {
		t.Fatal(err)
	}
	if err := pool.SetQueueRateLimit(ctx, db, q, 7, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	script, quotes := `<script>alert(1)</script>`, `it's "quoted" & <b>`
	odd := `Ã©\xff` + "\u202e\ufffd\u200b" // looks like broken UTF-8, is valid text
	long := strings.Repeat("é", 512)       // 1024 bytes
	jobs := map[string]int{script: 4, quotes: 2, odd: 3, long: 5}
	for k, n := range jobs {
		for range n {
			if _, err := pool.Insert(ctx, db, "w", nil, &pool.InsertOpts{Queue: q, ConcurrencyKey: k}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The first job of two keys runs: they are at their limit, the others wait with none holding.
	if _, err := db.Exec(ctx, `
		UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(), leased_by = 'w',
		       lease_token = id, lease_expires_at = now() + interval '1 hour'
		WHERE id IN (SELECT min(id) FROM leash.jobs WHERE concurrency_key = ANY ($1) GROUP BY concurrency_key)`,
		[]string{script, quotes}); err != nil {
		t.Fatal(err)
	}

	_, body := get(t, srv.URL+"/")
	row := between(t, body, `<tr data-queue="kq/a b">`, "</tr>")
	for _, want := range []string{`href="/queues/kq%2Fa%20b"`, `<td class="num">1</td>`, "7 per 2s"} {
		if !strings.Contains(row, want) {
			t.Errorf("queue row lacks %s:\n%s", want, row)
		}
	}

	code, body := get(t, srv.URL+"/queues/"+url.PathEscape(q))
	if code != http.StatusOK {
		t.Fatalf("queue page: %d %s", code, body)
	}
	if strings.Contains(body, "<script>alert") || strings.Contains(body, "<b>") {
		t.Fatal("a key reached the page unescaped")
	}
	atLimit := between(t, body, `id="keys-at-limit"`, "</table>")
	busiest := between(t, body, `id="keys-busiest"`, "</table>")
	keyRow := func(table, key string, holders, waiting string) {
		t.Helper()
		want := "<tr><td><code>" + html.EscapeString(key) + "</code></td><td class=\"num\">" + holders + "</td><td class=\"num\">" + waiting + "</td></tr>"
		if !strings.Contains(table, want) {
			t.Errorf("no row %s in\n%s", want, table)
		}
	}
	keyRow(atLimit, script, "1", "3")
	keyRow(atLimit, quotes, "1", "1")
	if strings.Count(atLimit, "<tr><td>") != 2 {
		t.Errorf("keys at their limit: want 2 rows:\n%s", atLimit)
	}
	shortLong := strings.Repeat("é", 40) + "…"
	keyRow(busiest, shortLong, "0", "5")
	keyRow(busiest, script, "1", "3")
	keyRow(busiest, odd, "0", "3")
	keyRow(busiest, quotes, "1", "1")
	if strings.Contains(body, strings.Repeat("é", 41)) {
		t.Error("the 1024-byte key is not shortened")
	}
	if i, j := strings.Index(busiest, shortLong), strings.Index(busiest, html.EscapeString(quotes)); i < 0 || j < i {
		t.Error("busiest keys not by jobs waiting, most first")
	}
	for _, bad := range []string{"/queues/%00", "/queues/" + strings.Repeat("q", 200), "/queues/a%0Ab"} {
		if code, _ := get(t, srv.URL+bad); code != http.StatusBadRequest {
			t.Errorf("%s: %d; want 400", bad, code)
		}
	}
	if code, _ := get(t, srv.URL+"/queues/nothing-here"); code != http.StatusNotFound {
		t.Errorf("unknown queue: %d; want 404", code)
	}
}

// A queue with a per-key rate limit: its page shows the limit and lists the keys out of room,
// with their waiting jobs and when they have room again; the queue without one has no such list.
func TestQueuePageKeysOutOfRate(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	ctx := context.Background()
	if err := pool.SetQueueKeyRateLimit(ctx, db, "kr", 2, time.Hour); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"spent", "spent", "spent", "fresh"} {
		if _, err := pool.Insert(ctx, db, "w", nil, &pool.InsertOpts{Queue: "kr", ConcurrencyKey: k}); err != nil {
			t.Fatal(err)
		}
	}
	// Key spent started twice within the hour (as claims record it): out of room for an hour.
	if _, err := db.Exec(ctx, `INSERT INTO leash.key_rates (queue, key, starts) VALUES ('kr', 'spent', ARRAY[now(), now()])`); err != nil {
		t.Fatal(err)
	}
	code, body := get(t, srv.URL+"/queues/kr")
	if code != http.StatusOK {
		t.Fatalf("queue page: %d %s", code, body)
	}
	limits := between(t, body, `id="queue-limits"`, "</table>")
	if !strings.Contains(limits, "2 per 1h0m0s") {
		t.Errorf("the queue's limits lack the per-key rate limit:\n%s", limits)
	}
	out := between(t, body, `id="keys-out-of-rate"`, "</table>")
	if !strings.Contains(out, "<code>spent</code></td><td class=\"num\">0</td><td class=\"num\">3</td><td class=\"num\">59m5") || strings.Contains(out, "fresh") {
		t.Errorf("keys out of room: want spent alone, 3 waiting, room again in about an hour:\n%s", out)
	}
	if err := pool.SetQueueKeyRateLimit(ctx, db, "kr", -1, 0); err != nil {
		t.Fatal(err)
	}
	if _, body := get(t, srv.URL+"/queues/kr"); strings.Contains(body, `id="keys-out-of-rate"`) {
		t.Error("a queue without a per-key rate limit lists keys out of room")
	}
}

// between returns the part of s from the first start to the end that follows it.
func between(t *testing.T, s, start, end string) string {
	t.Helper()
	i := strings.Index(s, start)
	if i < 0 {
		t.Fatalf("page lacks %s", start)
	}
	j := strings.Index(s[i:], end)
	if j < 0 {
		t.Fatalf("page lacks %s after %s", end, start)
	}
	return s[i : i+j]
}

// In a browser: the queue list links the queue's page, whose key at its limit is shown as text
// (its markup neither rendered nor run).
func TestQueuePageInBrowser(t *testing.T) {
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
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	bg := context.Background()
	const key = `<img src=x onerror="document.title='run'">`
	if err := pool.SetQueueMaxRunningPerKey(bg, db, "kq", 1); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := pool.Insert(bg, db, "w", nil, &pool.InsertOpts{Queue: "kq", ConcurrencyKey: key}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Exec(bg, `
		UPDATE leash.jobs SET state = 'running', attempt = 1, attempted_at = now(), leased_by = 'w',
		       lease_token = id, lease_expires_at = now() + interval '1 hour'
		WHERE id = (SELECT min(id) FROM leash.jobs)`); err != nil {
		t.Fatal(err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true))
	actx, cancel := chromedp.NewExecAllocator(bg, opts...)
	defer cancel()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancel = context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	step := func(a chromedp.Action[chromedp.Void]) {
		t.Helper()
		if _, err := chromedp.Run(ctx, a); err != nil {
			t.Fatalf("browser: %v", err)
		}
	}
	step(chromedp.Navigate(srv.URL + "/"))
	step(chromedp.Click(`#queue-list tr[data-queue="kq"] a`))
	step(chromedp.WaitVisible("#keys-at-limit"))
	cell, err := chromedp.Run(ctx, chromedp.Text("#keys-at-limit tr:nth-child(2) code"))
	if err != nil || cell != key {
		t.Fatalf("key at its limit shown as %q, %v", cell, err)
	}
	if imgs, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('img').length`)); err != nil || imgs != 0 {
		t.Fatalf("%d img elements on the page, %v", imgs, err)
	}
	if title, err := chromedp.Run(ctx, chromedp.Title()); err != nil || title == "run" {
		t.Fatalf("title %q, %v", title, err)
	}
}
