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
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/leashq/leash/internal/store"
)

//go:embed templates/*.html
var templates embed.FS

// Options configure the handler.
type Options struct {
	// DB is read for the admin page and readiness. Required.
	DB interface {
		store.DBTX
		Ping(ctx context.Context) error
	}
	// ListenerConnected reports the worker's LISTEN connection; nil means not applicable.
	ListenerConnected func() bool
	// Gatherer serves /metrics; nil disables it.
	Gatherer prometheus.Gatherer
	// AdminToken, when set, is required (as a bearer token or the basic-auth password) for the
	// admin page and its actions.
	AdminToken string
	// Refresh is the admin page's self-refresh period. Default 3s.
	Refresh time.Duration
	// Logger for errors. Default: discard.
	Logger *slog.Logger
}

type server struct {
	Options
	tmpl *template.Template
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
		"age":   fmtAge,
		"since": func(t time.Time) string { return fmtAge(time.Since(t)) },
		"deref": func(s *string) string {
			if s == nil {
				return ""
			}
			return *s
		},
		"short": func(s *string) string {
			if s == nil {
				return ""
			}
			if len(*s) > 160 {
				return (*s)[:160] + "…"
			}
			return *s
		},
		"seconds": func(d time.Duration) int { return int(d.Seconds()) },
	}).ParseFS(templates, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("parse admin templates: %w", err)
	}
	s := &server{Options: o, tmpl: t}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", s.ready)
	if o.Gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(o.Gatherer, promhttp.HandlerOpts{}))
	}
	admin := http.NewServeMux()
	admin.HandleFunc("GET /{$}", s.index)
	admin.HandleFunc("GET /jobs/{id}", s.job)
	admin.HandleFunc("POST /jobs/{id}/revoke", s.revoke)
	// Cross-origin POSTs (a page elsewhere submitting to this one) are refused.
	mux.Handle("/", s.auth(http.NewCrossOriginProtection().Handler(admin)))
	return mux, nil
}

func (s *server) ready(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.DB.Ping(ctx); err != nil {
		http.Error(w, "database unreachable: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	if s.ListenerConnected != nil && !s.ListenerConnected() {
		http.Error(w, "listener not connected", http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ready")
}

func (s *server) auth(next http.Handler) http.Handler {
	if s.AdminToken == "" {
		return next
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
	Status   store.Status
	Failures []store.JobRow
	Refresh  int
	Now      time.Time
	Flash    string
}

func (s *server) index(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	st, err := store.ReadStatus(ctx, s.DB, 200)
	if err != nil {
		s.fail(w, err)
		return
	}
	failures, err := store.RecentFailures(ctx, s.DB, 20)
	if err != nil {
		s.fail(w, err)
		return
	}
	s.render(w, "index.html", indexData{Status: st, Failures: failures, Refresh: int(s.Refresh.Seconds()), Now: time.Now(),
		Flash: r.URL.Query().Get("flash")})
}

func (s *server) job(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		http.Error(w, "bad job id", http.StatusBadRequest)
		return
	}
	j, err := store.GetJob(r.Context(), s.DB, id)
	if errors.Is(err, pgx.ErrNoRows) {
		http.Error(w, fmt.Sprintf("job %d not found", id), http.StatusNotFound)
		return
	}
	if err != nil {
		s.fail(w, err)
		return
	}
	s.render(w, "job.html", struct {
		Job     store.JobRow
		Flash   string
		Refresh int
	}{j, r.URL.Query().Get("flash"), int(s.Refresh.Seconds())})
}

func (s *server) revoke(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		http.Error(w, "bad job id", http.StatusBadRequest)
		return
	}
	reason := strings.TrimSpace(r.FormValue("reason"))
	if reason == "" {
		reason = "revoked from the admin page"
	}
	if len(reason) > 500 {
		reason = reason[:500]
	}
	ok, err := store.Revoke(r.Context(), s.DB, id, reason)
	if err != nil {
		s.fail(w, err)
		return
	}
	flash := fmt.Sprintf("Job %d revoked.", id)
	if !ok {
		flash = fmt.Sprintf("Job %d is unknown or already finished: nothing to revoke.", id)
	}
	back := "/jobs/" + strconv.FormatInt(id, 10)
	if r.FormValue("back") == "index" {
		back = "/"
	}
	http.Redirect(w, r, back+"?flash="+template.URLQueryEscaper(flash), http.StatusSeeOther)
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
	http.Error(w, "database error: "+err.Error(), http.StatusServiceUnavailable)
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
