package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
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

// The payload's env cannot hijack the command through the loader, a shell, an interpreter or a
// tool's configuration, send its traffic through a proxy, nor replace PATH or HOME, even where the
// operator allows every name; such a job fails permanently and the error names the variable.
func TestExecEnvDenyList(t *testing.T) {
	t.Parallel()
	h := handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond, "*")
	for _, name := range []string{"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "BASH_ENV", "ENV",
		"BASH_FUNC_echo%%", "BASH_FUNC_x", "PATH", "HOME", "IFS", "SHELLOPTS", "PS4", "PYTHONSTARTUP", "PYTHONPATH",
		"PERL5OPT", "RUBYOPT", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "GLIBC_TUNABLES", "GCONV_PATH", "GIT_SSH_COMMAND",
		"GIT_CONFIG_COUNT", "LEASH_JOB_ID", "A=B", "A\x00B", "1ABC", "", "A B", "é",
		"OPENSSL_CONF", "OPENSSL_MODULES", "OPENSSL_ENGINES", "RSYNC_RSH", "RSYNC_CONNECT_PROG", "GIT_DIR",
		"GIT_TEMPLATE_DIR", "GIT_SEQUENCE_EDITOR", "GIT_WORK_TREE", "XDG_CONFIG_HOME", "VIMINIT", "EXINIT", "PSQLRC",
		"PSQL_PAGER", "CURL_HOME", "WGETRC", "npm_config_script_shell", "NPM_CONFIG_USERCONFIG", "SSLKEYLOGFILE",
		"http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "Https_Proxy", "all_proxy", "ALL_PROXY", "no_proxy",
		"NO_PROXY", "ld_preload", "Path", "MAKEFLAGS", "TAR_OPTIONS", "KUBECONFIG", "SSL_CERT_FILE"} {
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
	// Allowed by "*": ordinary names; LANG and TZ replace the worker's, once.
	err := handle(h, `{"cmd":["/bin/sh","-c","test \"$(env | grep -c '^LANG=')\" = 1 && test \"$LANG\" = C && test \"$MY_VAR\" = v || exit 9"],"env":{"LANG":"C","MY_VAR":"v","_x1":"y"}}`)
	if err != nil {
		t.Fatalf("allowed env: %v", err)
	}
}

// The payload's env may set LANG, TZ and LC_* and what the operator allows, nothing else: names
// nobody thought to deny are refused too.
func TestExecEnvAllowList(t *testing.T) {
	t.Parallel()
	run := func(h pool.Handler, env map[string]string) error {
		payload, _ := json.Marshal(handlers.ExecArgs{Cmd: []string{"/bin/sh", "-c", `test "$LANG$TZ$LC_ALL$APP_X$EXACT" != "" || exit 9`}, Env: env})
		return handle(h, string(payload))
	}
	plain := handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond)
	if err := run(plain, map[string]string{"LANG": "C", "TZ": "UTC", "LC_ALL": "C", "LC_MESSAGES": "C"}); err != nil {
		t.Fatalf("LANG, TZ, LC_*: %v", err)
	}
	for _, name := range []string{"MY_VAR", "APP_X", "X", "SOMETOOL_PLUGIN_PATH", "lang", "lc_all"} {
		err := run(plain, map[string]string{"LANG": "C", name: "v"})
		if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), fmt.Sprintf("env variable %q is not allowed: not on the exec handler's env allow list", name)) {
			t.Errorf("%s without an allow list: %v", name, err)
		}
	}
	h := handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond, "APP_*", " EXACT ")
	if err := run(h, map[string]string{"APP_X": "1", "APP_": "2", "EXACT": "3"}); err != nil {
		t.Fatalf("allowed by pattern: %v", err)
	}
	for _, name := range []string{"EXACTLY", "app_x", "AP", "OTHER"} {
		if err := run(h, map[string]string{"APP_X": "1", name: "v"}); err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), fmt.Sprintf("env variable %q", name)) {
			t.Errorf("%s with patterns APP_*, EXACT: %v", name, err)
		}
	}
	// A pattern cannot let in what is denied.
	if err := run(handlers.Exec([]string{"/bin/sh"}, 100*time.Millisecond, "LD_*", "GIT_DIR"), map[string]string{"GIT_DIR": "/tmp", "LD_PRELOAD": "x"}); err == nil || !strings.Contains(err.Error(), `"GIT_DIR" is not allowed: makes git`) {
		t.Errorf("denied name allowed by a pattern: %v", err)
	}

	if err := handlers.CheckExecEnvAllow([]string{"APP_*", "EXACT", "*", "_x1"}); err != nil {
		t.Errorf("good patterns: %v", err)
	}
	for _, bad := range []string{"", "A*B", "A-B*", "1X", "**"} {
		if err := handlers.CheckExecEnvAllow([]string{"OK", bad}); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", bad)) {
			t.Errorf("pattern %q: %v", bad, err)
		}
	}
}

// A relative cmd[0] is refused: it would be checked against the worker's directory but run from
// the job's dir. Here "../../..../bin/true" names /bin/true (allowed) from the worker's directory
// and a planted script from dir.
func TestExecRefusesRelativeCommand(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/bin/true"); err != nil {
		t.Skip("no /bin/true")
	}
	wd, err := os.Getwd()
	if err == nil {
		wd, err = filepath.EvalSymlinks(wd)
	}
	if err != nil {
		t.Fatal(err)
	}
	up := len(strings.Split(strings.Trim(wd, "/"), "/")) + 1 // enough to reach / from the worker's directory
	root, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "d0")
	for i := 1; i <= up; i++ {
		dir = filepath.Join(dir, fmt.Sprintf("d%d", i))
	}
	marker := filepath.Join(root, "planted-ran")
	planted := filepath.Join(root, "d0", "bin", "true")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(planted), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(planted, []byte("#!/bin/sh\ntouch "+marker+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	rel := strings.Repeat("../", up) + "bin/true"
	h := handlers.Exec([]string{"/bin/true"}, 100*time.Millisecond)
	for _, c := range []struct{ cmd, dir string }{{rel, dir}, {rel, ""}, {"true", ""}, {"./true", filepath.Dir(planted)}} {
		payload, _ := json.Marshal(handlers.ExecArgs{Cmd: []string{c.cmd}, Dir: c.dir})
		err := handle(h, string(payload))
		if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), fmt.Sprintf("cmd[0] %q must be an absolute path", c.cmd)) {
			t.Errorf("cmd %q in %q: %v", c.cmd, c.dir, err)
		}
	}
	if _, err := os.Stat(marker); err == nil {
		t.Fatal("the planted command ran")
	}
	if err := handle(h, `{"cmd":["/bin/true"],"dir":`+strconv.Quote(dir)+`}`); err != nil {
		t.Fatalf("the allowed command itself: %v", err)
	}
}

// The allow list and cmd[0] are compared with symbolic links resolved, and the resolved file runs,
// under the name it was called by.
func TestExecResolvesSymlinks(t *testing.T) {
	t.Parallel()
	sh, err := filepath.EvalSymlinks("/bin/sh")
	if err != nil {
		t.Skip("no /bin/sh")
	}
	if _, err := os.Stat("/proc/self/exe"); err != nil {
		t.Skip("no /proc")
	}
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "mysh")    // -> the real shell
	other := filepath.Join(dir, "notsh")  // -> /bin/true: not allowed
	chain := filepath.Join(dir, "chain")  // -> mysh -> the real shell
	missing := filepath.Join(dir, "gone") // -> nothing
	for l, target := range map[string]string{link: sh, other: "/bin/true", chain: link, missing: filepath.Join(dir, "nothing")} {
		if err := os.Symlink(target, l); err != nil {
			t.Fatal(err)
		}
	}
	script := `tr '\0' ' ' < /proc/$$/cmdline; echo; readlink /proc/$$/exe; exit 3`
	cases := []struct {
		allow, cmd string
		ok         bool
	}{
		{link, sh, true}, // the list names a link to the command
		{sh, link, true}, // the command is a link to a listed file
		{"/bin/sh", chain, true},
		{link, other, false}, // a link elsewhere
		{sh, missing, false},
		{missing, missing, false}, // listed, but a dangling link: reported as missing
	}
	for _, c := range cases {
		payload, _ := json.Marshal(handlers.ExecArgs{Cmd: []string{c.cmd, "-c", script}})
		err := handle(handlers.Exec([]string{c.allow}, 100*time.Millisecond), string(payload))
		if !c.ok {
			if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), strconv.Quote(c.cmd)) {
				t.Errorf("allow %s, cmd %s: %v", c.allow, c.cmd, err)
			}
			continue
		}
		// argv[0] is cmd[0] as given; the file that runs is the resolved one.
		if err == nil || !strings.Contains(err.Error(), "exit code 3: "+c.cmd+" -c ") || !strings.HasSuffix(err.Error(), "\n"+sh) {
			t.Errorf("allow %s, cmd %s: %v", c.allow, c.cmd, err)
		}
	}
	if err := handle(handlers.Exec([]string{"/bin/sh"}, 0), `{"cmd":[`+strconv.Quote(missing)+`]}`); err == nil || !strings.Contains(err.Error(), "not in WORKER_EXEC_ALLOW") {
		t.Errorf("a missing command not on the list: %v", err)
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
