package web_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/web"
	"github.com/leashq/leash/pool"
)

// /readyz stays 200 on a schema migrated by a newer release, and says so with both versions.
func TestReadyzReportsNewerSchema(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	serve := func(report bool) string {
		h, err := web.New(web.Options{DB: db, ReportSchema: report, Release: "0.2.0"})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(h)
		defer srv.Close()
		code, body := get(t, srv.URL+"/readyz")
		if code != 200 {
			t.Fatalf("readyz %d %q", code, body)
		}
		return body
	}
	if body := serve(true); body != "ready\n" {
		t.Fatalf("current schema: %q", body)
	}
	db.Exec(context.Background(), "INSERT INTO leash.schema_migrations (version, name) VALUES (999, '999_future')")
	want := fmt.Sprintf("worker is older than the database schema: schema at version 999, this worker (release 0.2.0) knows up to %d;",
		pool.SchemaVersion())
	if body := serve(true); !strings.HasPrefix(body, "ready\n"+want) {
		t.Fatalf("newer schema: %q, want a line starting %q", body, want)
	}
	if body := serve(false); body != "ready\n" {
		t.Fatalf("without ReportSchema: %q", body)
	}
}
