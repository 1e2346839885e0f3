// Package web serves the worker binary's HTTP endpoints: /healthz, /readyz, /metrics, and a small
// server-rendered admin page to watch the queue and revoke jobs.
package web

import (
	"context"
	"crypto/subtle"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/leashq/leash/pool"
)

//go:embed templates/*.html
var templates embed.FS

// Options configure the handler.
type Options struct {
	// DB is read for the admin page and readiness. Required.
	DB interface {
		pool.DB
		Begin(ctx context.Context) (pgx.Tx, error)
		Ping(ctx context.Context) error
	}
	// ListenerConnected reports the worker's LISTEN connection; nil means not applicable.
	ListenerConnected func() bool
	// Ready, when set, says why the worker is not ready (nil when it is); /readyz answers 503
	// with its message. pool.Pool's Ready fits: database settings that stop the worker, a
	// listener down for longer than a reconnect takes.
	Ready func() error
	// Gatherer serves /metrics; nil disables it.
	Gatherer prometheus.Gatherer
	// AdminToken, when set, is required (as a bearer token or the basic-auth password) for the
	// admin page and its actions.
	AdminToken string
	// AdminOpen serves the admin page without a token when AdminToken is empty. Without it, an
	// empty AdminToken disables the admin page (403). Meant for a listener on loopback only.
	AdminOpen bool
	// AdminHosts are the host names (without port) the admin page answers to besides loopback
	// names (localhost, *.localhost) and IP literals; an entry starting with a dot matches every
	// subdomain. Any other Host header is refused (421), so a DNS-rebinding page cannot use the
	// admin page under its own name. Matching ignores case and a trailing dot.
	AdminHosts []string
	// ReportSchema makes /readyz compare the database's schema version with this binary's
	// migrations and add a line when the database was migrated by a newer release (still 200:
	// migrations are additive, so an older worker keeps working until it is replaced).
	ReportSchema bool
	// Release names this binary's release in that line.
	Release string
	// Refresh is the admin page's self-refresh period. Default 3s.
	Refresh time.Duration
	// Logger for errors. Default: discard.
	Logger *slog.Logger
}

type server struct {
	Options
	tmpl  *template.Template
	hosts []string // normalized AdminHosts
}

// New returns the handler for every endpoint.
func New(o Options) (http.Handler, error) {
	if o.Refresh == 0 {
		o.Refresh = 3 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	t, err := template.New("").Funcs(template.FuncMap{
		"age":        fmtAge,
		"pathEscape": url.PathEscape,
		"key":        shortKey,
		"short": func(s string) string {
			if len(s) > 160 {
				return truncate(s, 160) + "…"
			}
			return s
		},
	}).ParseFS(templates, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("parse admin templates: %w", err)
	}
	s := &server{Options: o, tmpl: t}
	for _, h := range o.AdminHosts {
		if h = normHost(h); h != "" {
			s.hosts = append(s.hosts, h)
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", s.ready)
	if o.Gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(o.Gatherer, promhttp.HandlerOpts{}))
	}
	admin := http.NewServeMux()
	admin.HandleFunc("GET /{$}", s.index)
	admin.HandleFunc("GET /jobs", s.jobs)
	admin.HandleFunc("GET /search", s.search)
	admin.HandleFunc("GET /jobs/{id}", s.job)
	admin.HandleFunc("POST /jobs/{id}/revoke", s.revoke)
	admin.HandleFunc("POST /jobs/{id}/retry", s.retry)
	admin.HandleFunc("GET /workflows/{id}", s.workflow)
	admin.HandleFunc("POST /workflows/{id}/revoke", s.revokeWorkflow)
	admin.HandleFunc("GET /queues/{name}", s.queue)
	admin.HandleFunc("POST /queues/pause", s.queueAction(true))
	admin.HandleFunc("POST /queues/resume", s.queueAction(false))
	// The Host check comes first: a DNS-rebinding page (its own name resolving to this address)
	// is refused before anything else; then the token; then cross-origin POSTs (a page elsewhere
	// submitting to this one) are refused.
	mux.Handle("/", s.checkHost(s.auth(http.NewCrossOriginProtection().Handler(admin))))
	return mux, nil
}

func (s *server) ready(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.DB.Ping(ctx); err != nil {
		// The detail (host names, user names, server messages) is for the log, not for whoever
		// can reach this unauthenticated endpoint.
		s.Logger.Warn("readiness: database unreachable", slog.Any("err", err))
		http.Error(w, "database unreachable", http.StatusServiceUnavailable)
		return
	}
	if s.ListenerConnected != nil && !s.ListenerConnected() {
		http.Error(w, "listener not connected", http.StatusServiceUnavailable)
		return
	}
	if s.Ready != nil {
		if err := s.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
	}
	fmt.Fprintln(w, "ready")
	if s.ReportSchema {
		c, err := pool.ReadSchemaStatus(ctx, s.DB)
		switch {
		case err != nil:
			s.Logger.Warn("readiness: cannot read the schema version", slog.Any("err", err))
		case c.Ahead():
			fmt.Fprintln(w, SchemaAheadNote(c, s.Release))
		}
	}
}

// SchemaAheadNote says that a worker of release is older than the database's schema, naming both
// versions.
func SchemaAheadNote(c pool.SchemaStatus, release string) string {
	return fmt.Sprintf("worker is older than the database schema: schema at version %d, this worker (release %s) knows up to %d; "+
		"migrations are additive, so it keeps working: replace it with a newer release", c.Current, release, c.Expected)
}

// checkHost refuses requests whose Host header is not a loopback name, an IP literal or one of
// AdminHosts. A browser sends the name it resolved, so a page on an attacker's name rebound to
// this address is refused; an IP literal cannot be rebound and is accepted.
func (s *server) checkHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.hostAllowed(r.Host) {
			http.Error(w, "this admin page does not answer to this host name (see WORKER_ADMIN_HOSTS)", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *server) hostAllowed(hostport string) bool {
	h := hostport
	if host, _, err := net.SplitHostPort(hostport); err == nil {
		h = host
	}
	h = normHost(strings.TrimSuffix(strings.TrimPrefix(h, "["), "]"))
	if h == "" {
		return false
	}
	if _, err := netip.ParseAddr(h); err == nil {
		return true
	}
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return true
	}
	for _, a := range s.hosts {
		if h == a || (strings.HasPrefix(a, ".") && strings.HasSuffix(h, a)) {
			return true
		}
	}
	return false
}

func normHost(h string) string { return strings.TrimSuffix(strings.ToLower(strings.TrimSpace(h)), ".") }

func (s *server) auth(next http.Handler) http.Handler {
	if s.AdminToken == "" {
		if s.AdminOpen {
			return next
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "the admin page is disabled: no admin token is configured (WORKER_ADMIN_TOKEN)", http.StatusForbidden)
		})
	}
	want := []byte(s.AdminToken)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := ""
		if _, pass, ok := r.BasicAuth(); ok {
			got = pass
		} else if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			got = b
		}
		if subtle.ConstantTimeCompare([]byte(got), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="leash admin (any user name, the admin token as password)"`)
			http.Error(w, "admin token required", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

type indexData struct {
	Status   pool.Status
	Failures []pool.JobRow
	Refresh  int
	Now      time.Time
	Flash    string
	// Charts are drawn from the last hour of sampled minutes; Sampled is false when no minute
	// of it was sampled.
	Charts  []chartView
	Sampled bool
	// Finished counts the jobs finished in the sampled minutes of the hour, by final state.
	Finished finishedCounts
	// Filters (none here), Queues and States feed the job list's filter form.
	Filters Filters
	Queues  []string
	States  []string
	// QueueList is every queue with a control row or queued or running jobs; Schedules every
	// durable schedule.
	QueueList []pool.QueueState
	Schedules []pool.ScheduleState
}

// Flash messages are chosen by a fixed code in the URL, never taken from it, so a crafted link
// cannot make the page say anything else.
const (
	flashRevoked      = "revoked"
	flashNotRevocable = "not-revocable"
)

func flashText(code string, id int64) string {
	if t := controlFlashText(code, id); t != "" {
		return t
	}
	if id <= 0 {
		return ""
	}
	switch code {
	case flashRevoked:
		return fmt.Sprintf("Job %d revoked.", id)
	case flashNotRevocable:
		return fmt.Sprintf("Job %d is unknown or already finished: nothing to revoke.", id)
	}
	return ""
}

func (s *server) index(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	// Queued and running jobs only: counting the finished ones would read the whole table at
	// every refresh. The throughput chart counts them per minute.
	st, err := pool.ReadStatus(ctx, s.DB, pool.StatusParams{Running: 200})
	if err != nil {
		s.fail(w, err)
		return
	}
	failures, err := pool.RecentFailures(ctx, s.DB, 20)
	if err != nil {
		s.fail(w, err)
		return
	}
	stats, err := pool.ReadMinuteStats(ctx, s.DB, chartMinutes)
	if err != nil {
		s.fail(w, err)
		return
	}
	queues, err := pool.ListQueues(ctx, s.DB)
	if err != nil {
		s.fail(w, err)
		return
	}
	schedules, err := pool.ListSchedules(ctx, s.DB)
	if err != nil {
		s.fail(w, err)
		return
	}
	q := r.URL.Query()
	id, _ := strconv.ParseInt(q.Get("job"), 10, 64)
	data := indexData{Status: st, Failures: failures, Refresh: int(s.Refresh.Seconds()), Now: time.Now(),
		Flash: flashText(q.Get("flash"), id), States: states, QueueList: queues,
		Schedules: schedules}
	data.Charts, data.Finished, data.Sampled = charts(stats)
	for _, c := range st.Counts {
		if !slices.Contains(data.Queues, c.Queue) {
			data.Queues = append(data.Queues, c.Queue)
		}
	}
	s.render(w, "index.html", data)
}

func (s *server) job(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		http.Error(w, "bad job id", http.StatusBadRequest)
		return
	}
	j, err := pool.GetJob(r.Context(), s.DB, id)
	if errors.Is(err, pool.ErrJobNotFound) {
		http.Error(w, fmt.Sprintf("job %d not found", id), http.StatusNotFound)
		return
	}
	if err != nil {
		s.fail(w, err)
		return
	}
	s.render(w, "job.html", struct {
		Job     pool.JobRow
		Flash   string
		Refresh int
	}{j, flashText(r.URL.Query().Get("flash"), id), int(s.Refresh.Seconds())})
}

func (s *server) revoke(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		http.Error(w, "bad job id", http.StatusBadRequest)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		http.Error(w, "bad form", http.StatusBadRequest)
		return
	}
	// pool.RevokeJob makes the reason storable (NUL bytes and invalid UTF-8 become U+FFFD, a long
	// one is cut), by the rule every text leash stores follows.
	reason := strings.TrimSpace(r.PostFormValue("reason"))
	if reason == "" {
		reason = "revoked from the admin page"
	}
	ok, err := pool.RevokeJob(r.Context(), s.DB, id, reason)
	if err != nil {
		s.fail(w, err)
		return
	}
	code := flashRevoked
	if !ok {
		code = flashNotRevocable
	}
	back := fmt.Sprintf("/jobs/%d?flash=%s", id, code)
	if r.PostFormValue("back") == "index" {
		back = fmt.Sprintf("/?flash=%s&job=%d", code, id)
	}
	http.Redirect(w, r, back, http.StatusSeeOther)
}

const maxFormBytes = 64 << 10

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func (s *server) render(w http.ResponseWriter, name string, data any) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := s.tmpl.ExecuteTemplate(w, name, data); err != nil {
		s.Logger.Error("render admin page", slog.String("page", name), slog.Any("err", err))
	}
}

func (s *server) fail(w http.ResponseWriter, err error) {
	s.Logger.Error("admin page", slog.Any("err", err))
	http.Error(w, "database error (the worker's log has the detail)", http.StatusServiceUnavailable)
}

func fmtAge(d time.Duration) string {
	neg := d < 0
	if neg {
		d = -d
	}
	var s string
	switch {
	case d < time.Second:
		s = fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		s = fmt.Sprintf("%.1fs", d.Seconds())
	case d < time.Hour:
		s = fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	default:
		s = fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	if neg {
		return "-" + s
	}
	return s
}
