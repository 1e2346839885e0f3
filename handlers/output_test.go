package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/handlers"
)

func (h *harness) output(t *testing.T, id int64, v any) {
	t.Helper()
	var raw []byte
	if err := h.db.QueryRow(context.Background(), `SELECT output FROM leash.jobs WHERE id = $1`, id).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("output of job %d: %q: %v", id, raw, err)
	}
}

// The built-in handlers record their result as the job's output, whatever bytes the receiver or
// the command sent.
func TestBuiltinHandlersRecordOutput(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		fmt.Fprint(w, "created\x00\xff"+strings.Repeat("é", 2000))
	}))
	defer srv.Close()
	h := newHarness(t, handlers.Options{})
	id, state, lastErr := h.run(t, "http", fmt.Sprintf(`{"url":%q}`, srv.URL))
	if state != "completed" {
		t.Fatalf("webhook: %s %q", state, lastErr)
	}
	var ho handlers.HTTPOutput
	h.output(t, id, &ho)
	if ho.Status != 201 || !strings.HasPrefix(ho.Body, "created\uFFFD") || len(ho.Body) > 1100 {
		t.Fatalf("webhook output: %d %q", ho.Status, ho.Body)
	}
	cleanForPostgres(t, "webhook output", ho.Body, 1100)

	sh, err := filepathAbs("/bin/sh")
	if err != nil {
		t.Skip("no /bin/sh")
	}
	x := newHarness(t, handlers.Options{ExecAllow: []string{sh}, ExecGrace: 200 * time.Millisecond})
	for _, c := range []struct {
		script string
		code   int
		state  string
	}{{`printf 'done\000\377'; exit 0`, 0, "completed"}, {`printf 'broken'; exit 3`, 3, "retryable"}} {
		id, state, lastErr := x.run(t, "exec", fmt.Sprintf(`{"cmd":["/bin/sh","-c",%q]}`, c.script))
		if state != c.state {
			t.Fatalf("%s: %s %q", c.script, state, lastErr)
		}
		var eo handlers.ExecOutput
		x.output(t, id, &eo)
		if eo.ExitCode != c.code || eo.Tail == "" {
			t.Fatalf("%s: output %+v", c.script, eo)
		}
		cleanForPostgres(t, "exec output", eo.Tail, 2100)
	}
}
