package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// `worker workflow show` lists the jobs, states and dependencies (names quoted, so that a step
// cannot write to the terminal); `worker workflow revoke` revokes the unfinished ones.
func TestWorkflowCommands(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	env := envOf("DATABASE_URL", url)
	db := pgtest.PoolFor(t, url)
	wf, err := pool.InsertWorkflow(context.Background(), db, "nightly", []pool.WorkflowJob{
		{Step: "extract", Kind: "noop"}, {Step: "load\x1b[2J", Kind: "noop", DependsOn: []string{"extract"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := strconv.FormatInt(wf.ID, 10)
	out, err := runCmd(t, env, "workflow", "show", id)
	if err != nil || !strings.Contains(out, `"nightly"`) || !strings.Contains(out, "pending") ||
		!strings.Contains(out, `"load\x1b[2J"`) || !strings.Contains(out, `"extract"`) || strings.Contains(out, "\x1b") {
		t.Fatalf("workflow show: %q, %v", out, err)
	}
	out, err = runCmd(t, env, "workflow", "revoke", id, "-reason", "not tonight")
	if err != nil || !strings.Contains(out, "2 unfinished job(s) revoked") {
		t.Fatalf("workflow revoke: %q, %v", out, err)
	}
	if out, err := runCmd(t, env, "workflow", "show", id); err != nil || strings.Count(out, "cancelled") != 2 {
		t.Fatalf("workflow show after revoke: %q, %v", out, err)
	}
	for _, bad := range [][]string{{"workflow"}, {"workflow", "show"}, {"workflow", "show", "x"}, {"workflow", "frob", "1"}, {"workflow", "show", "999999"}} {
		if _, err := runCmd(t, env, bad...); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}
