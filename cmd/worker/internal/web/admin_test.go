package web_test

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/pool"
)

// insertJob adds a job in a given state directly (no worker runs here) and returns its id.
func insertJob(t *testing.T, db *pgxpool.Pool, queue, kind, state string) int64 {
	t.Helper()
	var id int64
	err := db.QueryRow(context.Background(), `
		INSERT INTO leash.jobs (queue, kind, state, run_at, attempt, attempted_at, finished_at, lease_token, lease_expires_at)
		VALUES ($1, $2, $3, now() + interval '1 hour',
		        CASE WHEN $3 = 'available' THEN 0 ELSE 1 END,
		        CASE WHEN $3 = 'available' THEN NULL ELSE now() END,
		        CASE WHEN $3 IN ('completed', 'failed', 'cancelled') THEN now() END,
		        CASE WHEN $3 = 'running' THEN 1 END, CASE WHEN $3 = 'running' THEN now() + interval '1 hour' END)
		RETURNING id`, queue, kind, state).Scan(&id)
	if err != nil {
		t.Fatalf("insert %s/%s/%s: %v", queue, kind, state, err)
	}
	return id
}

var listedJob = regexp.MustCompile(`<tr data-job="(\d+)">`)

// listed returns the ids the job list shows, in order.
func listed(body string) []int64 {
	var ids []int64
	for _, m := range listedJob.FindAllStringSubmatch(body, -1) {
		id, _ := strconv.ParseInt(m[1], 10, 64)
		ids = append(ids, id)
	}
	return ids
}

func TestJobListFilters(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	a1 := insertJob(t, db, "a", "email", "available")
	a2 := insertJob(t, db, "a", "report", "completed")
	a3 := insertJob(t, db, "a", "email", "failed")
	b1 := insertJob(t, db, "b", "email", "running")
	b2 := insertJob(t, db, "b", "report", "cancelled")
	cases := map[string][]int64{
		"":                                 {b2, b1, a3, a2, a1},
		"?queue=a":                         {a3, a2, a1},
		"?queue=+a+":                       {a3, a2, a1}, // trimmed
		"?kind=email":                      {b1, a3, a1},
		"?state=completed":                 {a2},
		"?queue=a&kind=email":              {a3, a1},
		"?queue=a&kind=email&state=":       {a3, a1},
		"?queue=b&state=running":           {b1},
		"?queue=b&kind=email&state=failed": nil,
		"?queue=c":                         nil,
		"?before=" + fmt.Sprint(a3):        {a2, a1},
	}
	for q, want := range cases {
		code, body := get(t, srv.URL+"/jobs"+q)
		if got := listed(body); code != 200 || !slices.Equal(got, want) {
			t.Errorf("/jobs%s: %d, jobs %v, want %v", q, code, got, want)
		}
		if len(want) == 0 && !strings.Contains(body, `id="no-jobs"`) {
			t.Errorf("/jobs%s: no 'no job matches' line", q)
		}
	}
	// The filters are kept in the form.
	_, body := get(t, srv.URL+"/jobs?queue=b&kind=report&state=cancelled")
	for _, want := range []string{`name="queue" list="queues" value="b"`, `name="kind" value="report"`, `<option selected>cancelled</option>`} {
		if !strings.Contains(body, want) {
			t.Errorf("the form lacks %s", want)
		}
	}
}

// Pages of 50, the newest first, filters kept from page to page.
func TestJobListPages(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	var ids []int64
	for range 60 {
		ids = append(ids, insertJob(t, db, "q", "k", "completed"))
	}
	insertJob(t, db, "other", "k", "completed")
	code, body := get(t, srv.URL+"/jobs?queue=q")
	first := listed(body)
	next := regexp.MustCompile(`<a href="([^"]+)" id="next">`).FindStringSubmatch(body)
	if code != 200 || len(first) != 50 || first[0] != ids[59] || next == nil {
		t.Fatalf("first page: %d, %d jobs, next %v", code, len(first), next)
	}
	href := strings.ReplaceAll(next[1], "&amp;", "&")
	code, body = get(t, srv.URL+href)
	second := listed(body)
	if code != 200 || len(second) != 10 || second[0] != ids[9] || second[9] != ids[0] || strings.Contains(body, `id="next"`) {
		t.Fatalf("second page %s: %d, jobs %v", href, code, second)
	}
}

func TestSearchGoesToTheJob(t *testing.T) {
	t.Parallel()
	srv := serve(t, web.Options{AdminOpen: true})
	for in, want := range map[string]string{"42": "/jobs/42", " 42 ": "/jobs/42", "#7": "/jobs/7",
		"9223372036854775807": "/jobs/9223372036854775807"} {
		req, _ := http.NewRequest("GET", srv.URL+"/search?id="+url.QueryEscape(in), nil)
		if code, loc := do(t, req); code != http.StatusSeeOther || loc != want {
			t.Errorf("search %q: %d %q, want %q", in, code, loc, want)
		}
	}
	for _, in := range []string{"", "0", "-1", "abc", "4 2", "9223372036854775808", "1;DROP TABLE leash.jobs", "0x10", "1e3"} {
		req, _ := http.NewRequest("GET", srv.URL+"/search?id="+url.QueryEscape(in), nil)
		if code, body := do(t, req); code != http.StatusBadRequest || !strings.Contains(body, "positive whole number") {
			t.Errorf("search %q: %d %q", in, code, body)
		}
	}
}

// Whatever the query string holds, the answer is a 400 or a page, never a server error, and
// nothing of it comes back unescaped.
func TestHostileQueryParameters(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	insertJob(t, db, "default", "noop", "completed")
	const script = `<script>alert(1)</script>`
	esc := url.QueryEscape
	values := []string{
		strings.Repeat("x", 129), strings.Repeat("é", 65), strings.Repeat("q", 200_000),
		"a\x00b", "\x00", "\xff\xfe", "a\xc3", "\x1b[31m", "line\nbreak",
		`' OR 1=1 --`, `a'; DROP TABLE leash.jobs; --`, `%`, `_`, `\`, `"`, script, `"><script>alert(1)</script>`,
	}
	var raws []string
	for _, v := range values {
		for _, p := range []string{"queue", "kind", "state", "before", "id"} {
			raws = append(raws, p+"="+esc(v))
		}
	}
	raws = append(raws, "queue=%zz", "queue=a&queue=b", "state=running&state=failed", "id=1&id=2", "%00=%00",
		"queue=%FF", "kind=%00", "before=-5", "before=0", "before=99999999999999999999", "state=RUNNING", "state=running%00")
	for _, raw := range raws {
		for _, path := range []string{"/jobs", "/search", "/"} {
			req, err := http.NewRequest("GET", srv.URL+path+"?"+raw, nil)
			if err != nil {
				t.Fatal(err)
			}
			code, body := do(t, req)
			short := raw
			if len(short) > 60 {
				short = short[:60] + "…"
			}
			switch {
			case code >= 500:
				t.Errorf("%s?%s: %d", path, short, code)
			case code != 200 && code != http.StatusBadRequest && code != http.StatusSeeOther:
				t.Errorf("%s?%s: %d, want 200, 303 or 400", path, short, code)
			case strings.Contains(body, "<script>") || strings.Contains(body, "\x00") || strings.Contains(body, "\xff"):
				t.Errorf("%s?%s: the answer reflects the input unescaped: %.200q", path, short, body)
			case path == "/jobs" && code == 200 && (strings.HasPrefix(raw, "queue=") || strings.HasPrefix(raw, "kind=")) && len(listed(body)) != 0:
				// A filter no job matches (SQL-ish text included) lists nothing; parameters the
				// list does not read (id, junk names) leave it unfiltered.
				t.Errorf("%s?%s: lists %v, want nothing", path, short, listed(body))
			}
		}
	}
	// Names of exactly 128 bytes are fine: no job has them.
	if code, body := get(t, srv.URL+"/jobs?kind="+strings.Repeat("k", 128)); code != 200 || len(listed(body)) != 0 {
		t.Errorf("128-byte kind: %d", code)
	}
	// A query longer than the server reads is refused by net/http before any handler.
	if code, _ := get(t, srv.URL+"/jobs?queue="+strings.Repeat("q", 2<<20)); code != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("2 MB query: %d", code)
	}
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM leash.jobs").Scan(&n); err != nil || n != 1 {
		t.Fatalf("jobs after the attempts: %d, %v", n, err)
	}
}

var svgElement = regexp.MustCompile(`(?s)<svg .*?</svg>`)

// checkSVGs parses every SVG of a page as XML and returns the number of bars and line points
// each chart draws, by chart id.
func checkSVGs(t *testing.T, body string) map[string]int {
	t.Helper()
	drawn := map[string]int{}
	svgs := svgElement.FindAllString(body, -1)
	if len(svgs) != 3 {
		t.Fatalf("%d charts, want 3", len(svgs))
	}
	for _, svg := range svgs {
		if strings.Contains(svg, "NaN") || strings.Contains(svg, "Inf") {
			t.Errorf("NaN or Inf in %s", svg)
		}
		d := xml.NewDecoder(strings.NewReader(svg))
		d.Strict = true
		var id string
		for {
			tok, err := d.Token()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("chart is not well-formed XML: %v\n%s", err, svg)
			}
			se, ok := tok.(xml.StartElement)
			if !ok {
				continue
			}
			for _, a := range se.Attr {
				if a.Name.Local == "id" && se.Name.Local == "svg" {
					id = a.Value
				}
				if a.Name.Local == "points" {
					drawn[id] += len(strings.Fields(a.Value))
				}
			}
			if se.Name.Local == "rect" || se.Name.Local == "circle" {
				drawn[id]++
			}
		}
	}
	return drawn
}

// The index page draws the three charts from the sampled minutes; before any minute is sampled
// it says so and the charts are empty but valid.
func TestIndexCharts(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	srv := serve(t, web.Options{DB: db, AdminOpen: true})
	code, body := get(t, srv.URL+"/")
	if code != 200 || !strings.Contains(body, `id="no-samples"`) {
		t.Fatalf("before sampling: %d, no notice", code)
	}
	if drawn := checkSVGs(t, body); len(drawn) != 0 {
		t.Errorf("drawn before sampling: %v", drawn)
	}
	ctx := context.Background()
	// Jobs finished and started two minutes ago (the database clock), one waiting now.
	_, err := db.Exec(ctx, `
		INSERT INTO leash.jobs (kind, state, created_at, run_at, attempt, attempted_at, finished_at)
		SELECT 'noop', s, now() - interval '2 minutes', now() - interval '2 minutes', 1,
		       now() - interval '2 minutes' + interval '15 milliseconds', now() - interval '2 minutes' + interval '20 milliseconds'
		FROM unnest(ARRAY['completed', 'completed', 'failed']) s`)
	if err != nil {
		t.Fatal(err)
	}
	insertJob(t, db, "default", "noop", "available")
	if n, err := pool.SampleMinuteStats(ctx, db, pool.MinuteSampleParams{}); err != nil || n == 0 {
		t.Fatalf("sample: %d, %v", n, err)
	}
	code, body = get(t, srv.URL+"/")
	if code != 200 || strings.Contains(body, `id="no-samples"`) {
		t.Fatalf("after sampling: %d", code)
	}
	drawn := checkSVGs(t, body)
	if drawn["chart-finished-svg"] < 2 || drawn["chart-depth-svg"] < 1 || drawn["chart-pickup-svg"] < 1 {
		t.Errorf("drawn after sampling: %v", drawn)
	}
	for _, want := range []string{"2 completed, 1 failed, 0 cancelled", "15 ms", `aria-labelledby="chart-finished-title chart-finished-desc"`} {
		if !strings.Contains(body, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
}
