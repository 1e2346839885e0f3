package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
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
		{[]string{"queue", "limit", "mail", "-per-key", "2"}, "queue mail: at most 2 jobs of one key at once\n"},
		{[]string{"queue", "list"}, "PER KEY"},
		{[]string{"queue", "limit", "mail", "-per-key", "none"}, "queue mail has no per-key limit\n"},
		{[]string{"queue", "limit", "mail", "-rate", "2000/s"}, "queue mail: at most 2000/s starts\n"},
		{[]string{"queue", "list"}, "2000/s"},
		{[]string{"queue", "limit", "mail", "-rate", "30/1m30s"}, "queue mail: at most 30/1m30s starts\n"},
		{[]string{"queue", "limit", "mail", "-rate", "none"}, "queue mail has no rate limit\n"},
		{[]string{"queue", "limit", "mail", "-key-rate", "1/s"}, "queue mail: at most 1/s starts of one key\n"},
		{[]string{"queue", "list"}, "KEY RATE"},
		{[]string{"queue", "limit", "mail", "-key-rate", "1000/1m"}, "queue mail: at most 1000/min starts of one key\n"},
		{[]string{"queue", "list"}, "1000/min"},
		{[]string{"queue", "limit", "mail", "-key-rate", "none"}, "queue mail has no per-key rate limit\n"},
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
		{"queue", "limit", "mail", "-per-key", "-1"}, {"queue", "limit", "mail", "-per-key"}, {"queue", "limit", "mail", "-cap", "2"},
		{"queue", "limit", "mail", "-rate", "5"}, {"queue", "limit", "mail", "-rate", "-1/s"}, {"queue", "limit", "mail", "-rate", "5/0s"},
		{"queue", "limit", "mail", "-rate", "5/forever"}, {"queue", "limit", "mail", "-key-rate", "1001/s"},
		{"queue", "limit", "mail", "-key-rate", "1/0s"}, {"queue", "limit", "mail", "-key-rate", "x"},
		{"queue", "pause", "bad\xff"}, {"queue", "pause", strings.Repeat("q", 200)}} {
		if _, err := runCmd(t, env, bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestScheduleRetryAndStatusCommands(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	env := envOf("DATABASE_URL", url)
	db := pgtest.PoolFor(t, url)
	ctx := context.Background()
	steps := []struct {
		args []string
		want string
	}{
		{[]string{"schedule", "list"}, "no schedules"},
		{[]string{"schedule", "add", "-name", "nightly", "-spec", "CRON_TZ=Europe/Paris 0 3 * * *", "-kind", "report", "-payload", `{"full":true}`}, "schedule nightly stored"},
		{[]string{"schedule", "add", "-name", "nightly", "-spec", "@every 1h", "-kind", "report"}, "schedule nightly stored"},
		{[]string{"schedule", "list"}, "@every 1h"},
		{[]string{"schedule", "remove", "nightly"}, "schedule nightly removed"},
	}
	for _, s := range steps {
		out, err := runCmd(t, env, s.args...)
		if err != nil || !strings.Contains(out, s.want) {
			t.Fatalf("%v: %q, %v; want %q", s.args, out, err, s.want)
		}
	}
	for _, bad := range [][]string{{"schedule"}, {"schedule", "frob"}, {"schedule", "remove", "nightly"},
		{"schedule", "add", "-name", "x", "-spec", "61 * * * *", "-kind", "k"},
		{"schedule", "add", "-name", "x", "-spec", "@daily"},
		{"schedule", "add", "-name", "x", "-spec", "@daily", "-kind", "k", "-payload", "{nope"},
		{"retry"}, {"retry", "abc"}, {"retry", "999999"}, {"status", "x"}, {"status", "999999"}} {
		if _, err := runCmd(t, env, bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}

	// retry and status ID on a failed job with output.
	var id int64
	if err := db.QueryRow(ctx, `INSERT INTO leash.jobs (kind, state, attempt, max_attempts, finished_at, last_error, output, unique_key)
		VALUES ('k', 'failed', 1, 1, now(), e'boom\x1b[2J', '{"exit_code": 3, "tail": "x"}', 'u1') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	out, err := runCmd(t, env, "status", strconv.FormatInt(id, 10))
	if err != nil || !strings.Contains(out, `"exit_code": 3`) || !strings.Contains(out, "failed") || !strings.Contains(out, "u1") || strings.Contains(out, "\x1b") {
		t.Fatalf("status ID: %q, %v", out, err)
	}
	if out, err := runCmd(t, env, "retry", strconv.FormatInt(id, 10)); err != nil || !strings.Contains(out, "will run again") {
		t.Fatalf("retry: %q, %v", out, err)
	}
	if _, err := runCmd(t, env, "retry", strconv.FormatInt(id, 10)); err == nil {
		t.Fatal("retry of a queued job accepted")
	}
	out, err = runCmd(t, env, "enqueue", "-kind", "k", "-unique-key", "u1")
	if err != nil || strings.TrimSpace(out) != strconv.FormatInt(id, 10) {
		t.Fatalf("enqueue of a held key: %q, %v; want the holder's id %d", out, err, id)
	}
}
