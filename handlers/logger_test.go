package handlers_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

// The built-in handlers log through pool.Logger: each line names the job it is about.
func TestHandlersLogWithTheJob(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "later", http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	var logs syncbuf.Buffer
	db := pgtest.Pool(t)
	evs := make(events, 10)
	p, err := pool.New(db, pool.Config{PollInterval: 50 * time.Millisecond, Observer: evs,
		Logger:       slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		RetryBackoff: func(int) time.Duration { return time.Hour }})
	if err != nil {
		t.Fatal(err)
	}
	if err := handlers.Register(p, handlers.Options{HTTPClient: srv.Client()}); err != nil {
		t.Fatal(err)
	}
	go p.Run(context.Background())
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	id, err := pool.Insert(context.Background(), db, "http", map[string]string{"url": srv.URL + "/hook?token=secret"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-evs:
	case <-time.After(20 * time.Second):
		t.Fatal("job did not finish")
	}
	var line map[string]any
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, `"webhook answered"`) {
			json.Unmarshal([]byte(l), &line)
		}
	}
	if line == nil {
		t.Fatalf("no webhook line in:\n%s", logs.String())
	}
	if line["job_id"] != float64(id) || line["kind"] != "http" || line["attempt"] != float64(1) || line["status"] != float64(503) ||
		line["level"] != "INFO" || strings.Contains(line["url"].(string), "secret") {
		t.Fatalf("line %v", line)
	}
}
