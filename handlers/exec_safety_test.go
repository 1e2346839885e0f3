package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/pool"
)

// handle runs h on a job with this payload, outside any pool: the error as the pool would get it.
func handle(h pool.Handler, payload string) error {
	return h.Handle(context.Background(), &pool.Job{ID: 7, Kind: "test", Payload: json.RawMessage(payload), Attempt: 1, Token: 9})
}

// cleanForPostgres fails unless s can be stored as PostgreSQL text: valid UTF-8, no NUL.
func cleanForPostgres(t *testing.T, what, s string, max int) {
	t.Helper()
	if !utf8.ValidString(s) || strings.ContainsRune(s, 0) || len(s) > max {
		t.Errorf("%s: not clean text of at most %d bytes (%d bytes): %q", what, max, len(s), s)
	}
}

// The payload's env cannot hijack the command through the loader, a shell or an interpreter, nor
// replace PATH or HOME; such a job fails permanently and the error names the variable.
func TestExecEnvDenyList(t *testing.T) {
	t.Parallel()
	h := handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond)
	for _, name := range []string{"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "BASH_ENV", "ENV",
		"BASH_FUNC_echo%%", "BASH_FUNC_x", "PATH", "HOME", "IFS", "SHELLOPTS", "PS4", "PYTHONSTARTUP", "PYTHONPATH",
		"PERL5OPT", "RUBYOPT", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "GLIBC_TUNABLES", "GCONV_PATH", "GIT_SSH_COMMAND",
		"GIT_CONFIG_COUNT", "LEASH_JOB_ID", "A=B", "A\x00B", "1ABC", "", "A B", "é"} {
		payload, _ := json.Marshal(handlers.ExecArgs{Cmd: []string{"/bin/sh", "-c", "exit 0"}, Env: map[string]string{"OK": "1", name: "/tmp/evil.so"}})
		err := handle(h, string(payload))
		if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), fmt.Sprintf("env variable %q", name)) {
			t.Errorf("env %q: %v", name, err)
			continue
		}
		cleanForPostgres(t, "error for "+name, err.Error(), 300)
	}
	if err := handle(h, `{"cmd":["/bin/sh","-c","exit 0"],"env":{"X":"a\u0000b"}}`); err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), "X has a NUL") {
		t.Errorf("NUL in a value: %v", err)
	}
	if err := handle(h, `{"cmd":["/bin/sh","-c","exit 0\u0000"]}`); err == nil || !pool.IsPermanent(err) {
		t.Errorf("NUL in an argument: %v", err)
	}
	// Allowed: ordinary names; LANG and TZ replace the worker's, once.
	err := handle(h, `{"cmd":["/bin/sh","-c","test \"$(env | grep -c '^LANG=')\" = 1 && test \"$LANG\" = C && test \"$MY_VAR\" = v || exit 9"],"env":{"LANG":"C","MY_VAR":"v","_x1":"y"}}`)
	if err != nil {
		t.Fatalf("allowed env: %v", err)
	}
}

// A command's output with NUL bytes, invalid UTF-8 and a character cut by the 2 kB tail comes
// back as clean, bounded text; the job's last_error takes it.
func TestExecOutputIsCleanText(t *testing.T) {
	t.Parallel()
	script := `printf 'start\000\377'; head -c 100000 /dev/zero; printf '\303\251%.0s' $(seq 1 2000); printf 'bad\377\376 nul\000 end'; exit 4`
	payload, _ := json.Marshal(handlers.ExecArgs{Cmd: []string{"/bin/sh", "-c", script}})
	err := handle(handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond), string(payload))
	if err == nil || !strings.Contains(err.Error(), "exit code 4") || !strings.HasSuffix(err.Error(), " end") {
		t.Fatalf("got %v", err)
	}
	cleanForPostgres(t, "exec error", err.Error(), 2200)

	h := newHarness(t, handlers.Options{ExecAllow: []string{"/bin/sh"}})
	_, state, lastErr := h.run(t, "exec", string(payload))
	if state != "retryable" || !strings.Contains(lastErr, "exit code 4") {
		t.Fatalf("job: %s %q", state, lastErr)
	}
	cleanForPostgres(t, "last_error", lastErr, 2200)
}
