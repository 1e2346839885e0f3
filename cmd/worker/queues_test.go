package main

import (
	"context"
	"strings"
	"testing"

	"github.com/leashq/leash/internal/pgtest"
)

func TestQueueCommands(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	env := envOf("DATABASE_URL", url)
	db := pgtest.PoolFor(t, url)
	if _, err := db.Exec(context.Background(), `INSERT INTO leash.jobs (queue, kind) VALUES ('mail', 'x'), ('mail', 'x'), (e'evil\x1b[2J', 'x')`); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		args []string
		want string
	}{
		{[]string{"queue", "pause", "mail"}, "queue mail paused\n"},
		{[]string{"queue", "pause", "mail"}, "queue mail paused (it already was)\n"},
		{[]string{"queue", "cap", "mail", "3"}, "queue mail capped at 3 running jobs\n"},
		{[]string{"queue", "list"}, "paused since"},
		{[]string{"queue", "list"}, `"evil\x1b[2J"`},
		{[]string{"queue", "resume", "mail"}, "queue mail resumed\n"},
		{[]string{"queue", "resume", "mail"}, "queue mail was not paused\n"},
		{[]string{"queue", "cap", "mail", "none"}, "queue mail uncapped\n"},
	}
	for _, s := range steps {
		out, err := runCmd(t, env, s.args...)
		if err != nil || !strings.Contains(out, s.want) {
			t.Fatalf("%v: %q, %v; want %q", s.args, out, err, s.want)
		}
	}
	out, _ := runCmd(t, env, "queue", "list")
	if !strings.Contains(out, "mail") || !strings.Contains(out, "active") || strings.Contains(out, "\x1b") {
		t.Fatalf("queue list: %q", out)
	}
	for _, bad := range [][]string{{"queue"}, {"queue", "frob"}, {"queue", "pause"}, {"queue", "pause", "a", "b"},
		{"queue", "cap", "mail", "-1"}, {"queue", "cap", "mail", "lots"}, {"queue", "pause", ""},
		{"queue", "pause", "bad\xff"}, {"queue", "pause", strings.Repeat("q", 200)}} {
		if _, err := runCmd(t, env, bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
