package web_test

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/pool"
)

func postForm(t *testing.T, target string, form url.Values) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", target, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return do(t, req)
}

// Pause and Resume buttons: the queue list shows the state, the POSTs change it, hostile queue
// names are refused, and cross-site POSTs are refused like Revoke.
func TestQueueButtons(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	ctx := context.Background()
	insertJob(t, db, "mail", "send", "available")
	if err := pool.SetQueueMaxRunning(ctx, db, "reports", 4); err != nil {
		t.Fatal(err)
	}
	_, body := get(t, srv.URL+"/")
	for _, want := range []string{`data-queue="mail"`, `data-queue="reports"`, `action="/queues/pause"`} {
		if !strings.Contains(body, want) {
			t.Fatalf("index lacks %s", want)
		}
	}
	code, loc := postForm(t, srv.URL+"/queues/pause", url.Values{"queue": {"mail"}})
	if code != http.StatusSeeOther || !strings.Contains(loc, "flash=queue-paused") {
		t.Fatalf("pause: %d %q", code, loc)
	}
	if qs, _ := pool.ListQueues(ctx, db); len(qs) != 2 || qs[0].Name != "mail" || qs[0].PausedAt == nil {
		t.Fatalf("after pause: %+v", qs)
	}
	_, body = get(t, srv.URL+loc)
	if !strings.Contains(body, "Queue paused") || !strings.Contains(body, `action="/queues/resume"`) {
		t.Fatal("index after pause shows neither the message nor a Resume button")
	}
	if code, loc = postForm(t, srv.URL+"/queues/pause", url.Values{"queue": {"mail"}}); !strings.Contains(loc, "flash=queue-unchanged") {
		t.Fatalf("pause again: %d %q", code, loc)
	}
	if code, loc = postForm(t, srv.URL+"/queues/resume", url.Values{"queue": {"mail"}}); !strings.Contains(loc, "flash=queue-resumed") {
		t.Fatalf("resume: %d %q", code, loc)
	}
	for _, bad := range []string{"", "a\x00b", "\xff", strings.Repeat("q", 200), "line\nbreak"} {
		if code, _ := postForm(t, srv.URL+"/queues/pause", url.Values{"queue": {bad}}); code != http.StatusBadRequest {
			t.Errorf("queue %q: %d; want 400", bad, code)
		}
	}
	req, _ := http.NewRequest("POST", srv.URL+"/queues/pause", strings.NewReader("queue=mail"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	if code, _ := do(t, req); code != http.StatusForbidden {
		t.Fatalf("cross-site pause: %d; want 403", code)
	}
}

// The job page shows the output and the unique key, and offers Retry on a failed or cancelled
// job; the retry runs through leash.retry_job.
func TestRetryButtonAndOutput(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	ctx := context.Background()
	var id int64
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, state, attempt, max_attempts, finished_at, output, unique_key)
		VALUES ('k', 'failed', 1, 1, now(), '{"status": 500, "body": "<script>x</script>"}', 'key-1') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	_, body := get(t, fmt.Sprintf("%s/jobs/%d", srv.URL, id))
	if !strings.Contains(body, `id="retry"`) || !strings.Contains(body, "key-1") || strings.Contains(body, "<script>x") ||
		!strings.Contains(body, html.EscapeString(`"body": "<script>x</script>"`)) {
		t.Fatalf("job page: retry button, unique key or escaped output missing")
	}
	code, loc := postForm(t, fmt.Sprintf("%s/jobs/%d/retry", srv.URL, id), nil)
	if code != http.StatusSeeOther || loc != fmt.Sprintf("/jobs/%d?flash=retried", id) {
		t.Fatalf("retry: %d %q", code, loc)
	}
	var state string
	db.QueryRow(ctx, `SELECT state FROM leash.jobs WHERE id = $1`, id).Scan(&state)
	if state != "available" {
		t.Fatalf("state after retry: %s", state)
	}
	if _, loc = postForm(t, fmt.Sprintf("%s/jobs/%d/retry", srv.URL, id), nil); loc != fmt.Sprintf("/jobs/%d?flash=not-retryable", id) {
		t.Fatalf("retry of a queued job: %q", loc)
	}
	_, body = get(t, srv.URL+loc)
	if strings.Contains(body, `id="retry"`) || !strings.Contains(body, "nothing to retry") {
		t.Fatal("queued job's page offers Retry or lacks the message")
	}
	if code, _ := postForm(t, srv.URL+"/jobs/abc/retry", nil); code != http.StatusBadRequest {
		t.Fatalf("bad id: %d", code)
	}
	if err := pool.UpsertSchedule(ctx, db, pool.Schedule{Name: "nightly", Spec: "@daily", Kind: "report"}); err != nil {
		t.Fatal(err)
	}
	if _, body = get(t, srv.URL+"/"); !strings.Contains(body, "nightly") || !strings.Contains(body, "@daily") {
		t.Fatal("index does not list the schedule")
	}
}
