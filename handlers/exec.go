package handlers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/leashq/leash/pool"
)

// Exec handler settings.
const (
	ExecTimeoutDefault = 10 * time.Minute
	ExecGraceDefault   = 5 * time.Second
	execTailBytes      = 2048
)

// ExecArgs is the payload of an "exec" job.
type ExecArgs struct {
	// Cmd is the argv; Cmd[0] must be on the allow list. Required.
	Cmd []string `json:"cmd"`
	// Env adds variables to the child's environment.
	Env map[string]string `json:"env,omitempty"`
	// Dir is the working directory.
	Dir string `json:"dir,omitempty"`
	// Timeout, default 10m.
	Timeout Duration `json:"timeout,omitempty"`
}

// ErrExecDisabled fails exec jobs on a worker with no allow list.
var ErrExecDisabled = errors.New("exec handler is disabled on this worker: set WORKER_EXEC_ALLOW to the commands it may run")

// Exec runs an allow-listed command. allow holds command paths; an empty list disables the
// handler (jobs fail permanently saying so). The child runs in its own process group with a small
// environment (PATH, HOME, LANG, TZ, the payload's env) plus LEASH_JOB_ID, LEASH_LEASE_TOKEN and
// LEASH_ATTEMPT; the worker's own variables (DATABASE_URL...) are not passed on. The payload's env
// may not set variables that make the command load or run other code (see [EnvDenied]): such a
// job fails permanently naming the variable. When the job's context ends (revoked, lease lost,
// shutdown) or its timeout passes, the group gets SIGTERM, then SIGKILL after grace. A non-zero
// exit fails the attempt with the exit code and the output's tail (at most 2 kB, valid UTF-8,
// NUL bytes replaced). Kind "exec".
func Exec(allow []string, grace time.Duration) pool.Handler {
	if grace <= 0 {
		grace = ExecGraceDefault
	}
	allowed := map[string]bool{}
	for _, a := range allow {
		if a = strings.TrimSpace(a); a != "" {
			allowed[filepath.Clean(a)] = true
		}
	}
	return pool.Args(func(ctx context.Context, job *pool.Job, a ExecArgs) error {
		if len(allowed) == 0 {
			return pool.Permanent(ErrExecDisabled)
		}
		if len(a.Cmd) == 0 || a.Cmd[0] == "" {
			return pool.Permanent(errors.New("exec: cmd must be a non-empty argv array"))
		}
		for i, arg := range a.Cmd {
			if strings.IndexByte(arg, 0) >= 0 {
				return pool.Permanent(fmt.Errorf("exec: cmd[%d] contains a NUL byte", i))
			}
		}
		if strings.IndexByte(a.Dir, 0) >= 0 {
			return pool.Permanent(errors.New("exec: dir contains a NUL byte"))
		}
		if err := checkEnv(a.Env); err != nil {
			return pool.Permanent(err)
		}
		path, err := resolve(a.Cmd[0], allowed)
		if err != nil {
			return pool.Permanent(err)
		}
		timeout := time.Duration(a.Timeout)
		if timeout == 0 {
			timeout = ExecTimeoutDefault
		}
		if timeout < 0 {
			return pool.Permanent(fmt.Errorf("exec: timeout %s is negative", timeout))
		}
		return runChild(ctx, job, path, a, timeout, grace)
	})
}

// resolve finds the command and checks it against the allow list, as given and as resolved.
func resolve(name string, allowed map[string]bool) (string, error) {
	path, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("exec: %q: %w", name, err)
	}
	abs, _ := filepath.Abs(path)
	if allowed[filepath.Clean(name)] || allowed[abs] {
		return path, nil
	}
	return "", fmt.Errorf("exec: %q is not in WORKER_EXEC_ALLOW", name)
}

func runChild(ctx context.Context, job *pool.Job, path string, a ExecArgs, timeout, grace time.Duration) error {
	cmd := exec.Command(path, a.Cmd[1:]...)
	cmd.Dir = a.Dir
	cmd.Env = childEnv(job, a.Env)
	out := &tail{max: execTailBytes}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", a.Cmd[0], err)
	}
	pgid := cmd.Process.Pid
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var stopped error
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		stopped = context.Cause(ctx)
	case <-timer.C:
		stopped = fmt.Errorf("exec %s: timed out after %s", a.Cmd[0], timeout)
	}
	if stopped != nil {
		syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case err = <-done:
		case <-time.After(grace):
			syscall.Kill(-pgid, syscall.SIGKILL)
			err = <-done
		}
	}
	// Whatever the child left behind in its group goes too.
	syscall.Kill(-pgid, syscall.SIGKILL)
	if stopped != nil {
		return stopped
	}
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return fmt.Errorf("exec %s: exit code %d: %s", a.Cmd[0], ee.ExitCode(), out.text())
		}
		return fmt.Errorf("exec %s: %w", a.Cmd[0], err)
	}
	return nil
}

// EnvDenied says why the payload's env may not set name ("" when it may). Refused: names that are
// not [A-Za-z_][A-Za-z0-9_]*; PATH and HOME (the worker's own are passed on: a job choosing them
// chooses which programs and startup files run) and LEASH_* (set by the worker); and variables
// that make the dynamic loader, a shell or an interpreter load or run other code: LD_*, DYLD_*,
// BASH_FUNC_*, GIT_CONFIG*, BASH_ENV, ENV, IFS, SHELLOPTS, PYTHONSTARTUP, PERL5OPT, NODE_OPTIONS,
// JAVA_TOOL_OPTIONS and the like (the full list is envDeniedNames).
func EnvDenied(name string) string {
	if !validEnvName(name) {
		return "not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
	}
	for _, p := range envDeniedPrefixes {
		if strings.HasPrefix(name, p.prefix) {
			return p.why
		}
	}
	if why, ok := envDeniedNames[name]; ok {
		return why
	}
	return ""
}

func validEnvName(name string) bool {
	if name == "" {
		return false
	}
	for i, c := range []byte(name) {
		switch {
		case c == '_', c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

const (
	whyLoader = "changes what the dynamic loader or libc loads"
	whyShell  = "makes a shell run other code"
	whyInterp = "makes an interpreter load or run other code"
	whyTool   = "makes a tool run another program"
	whyWorker = "set by the worker"
)

var envDeniedPrefixes = []struct{ prefix, why string }{
	{"LD_", whyLoader}, {"DYLD_", whyLoader}, {"BASH_FUNC_", whyShell}, {"GIT_CONFIG", whyTool}, {"LEASH_", whyWorker},
}

var envDeniedNames = map[string]string{
	"PATH": whyWorker, "HOME": whyWorker,
	"GCONV_PATH": whyLoader, "LOCPATH": whyLoader, "GLIBC_TUNABLES": whyLoader, "MALLOC_CONF": whyLoader, "NLSPATH": whyLoader,
	"HOSTALIASES": whyLoader, "LOCALDOMAIN": whyLoader, "RES_OPTIONS": whyLoader, "RESOLV_HOST_CONF": whyLoader,
	"BASH_ENV": whyShell, "ENV": whyShell, "IFS": whyShell, "CDPATH": whyShell, "SHELLOPTS": whyShell,
	"BASHOPTS": whyShell, "PS4": whyShell, "PROMPT_COMMAND": whyShell, "GLOBIGNORE": whyShell, "ZDOTDIR": whyShell,
	"PYTHONSTARTUP": whyInterp, "PYTHONPATH": whyInterp, "PYTHONHOME": whyInterp, "PYTHONINSPECT": whyInterp,
	"PYTHONWARNINGS": whyInterp, "PYTHONBREAKPOINT": whyInterp, "PYTHONUSERBASE": whyInterp, "PYTHONSAFEPATH": whyInterp,
	"PERL5OPT": whyInterp, "PERL5LIB": whyInterp, "PERLLIB": whyInterp, "PERL5DB": whyInterp,
	"RUBYOPT": whyInterp, "RUBYLIB": whyInterp, "NODE_OPTIONS": whyInterp, "NODE_PATH": whyInterp,
	"JAVA_TOOL_OPTIONS": whyInterp, "_JAVA_OPTIONS": whyInterp, "JDK_JAVA_OPTIONS": whyInterp, "CLASSPATH": whyInterp,
	"LUA_INIT": whyInterp, "LUA_PATH": whyInterp, "LUA_CPATH": whyInterp, "PHPRC": whyInterp, "PHP_INI_SCAN_DIR": whyInterp,
	"GIT_SSH": whyTool, "GIT_SSH_COMMAND": whyTool, "GIT_EXEC_PATH": whyTool, "GIT_ASKPASS": whyTool,
	"GIT_EXTERNAL_DIFF": whyTool, "GIT_PAGER": whyTool, "GIT_EDITOR": whyTool, "GIT_PROXY_COMMAND": whyTool,
	"SSH_ASKPASS": whyTool, "PAGER": whyTool, "EDITOR": whyTool, "VISUAL": whyTool, "BROWSER": whyTool,
	"LESSOPEN": whyTool, "LESSCLOSE": whyTool, "MANPAGER": whyTool,
}

// checkEnv refuses the payload's env when a name is denied or a value holds a NUL byte; the
// error names the first offending variable (in sorted order).
func checkEnv(env map[string]string) error {
	for _, k := range slices.Sorted(maps.Keys(env)) {
		if why := EnvDenied(k); why != "" {
			return fmt.Errorf("exec: env variable %s is not allowed: %s", quoteName(k), why)
		}
		if strings.IndexByte(env[k], 0) >= 0 {
			return fmt.Errorf("exec: env variable %s has a NUL byte in its value", k)
		}
	}
	return nil
}

// quoteName shows a variable name in an error: quoted (so control bytes are escaped) and short.
func quoteName(k string) string {
	if len(k) > 64 {
		return strconv.Quote(k[:64]) + "..."
	}
	return strconv.Quote(k)
}

func childEnv(job *pool.Job, extra map[string]string) []string {
	var env []string
	for _, k := range []string{"PATH", "HOME", "LANG", "TZ"} {
		if _, override := extra[k]; override {
			continue // LANG and TZ may be chosen by the job, once
		}
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(extra)) {
		env = append(env, k+"="+extra[k])
	}
	return append(env,
		"LEASH_JOB_ID="+strconv.FormatInt(job.ID, 10),
		"LEASH_LEASE_TOKEN="+strconv.FormatInt(job.Token, 10),
		"LEASH_ATTEMPT="+strconv.Itoa(job.Attempt))
}

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.max {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.max:]...)
	}
	return len(p), nil
}

// text is the output's tail as clean text: valid UTF-8, no NUL bytes, at most max bytes.
func (t *tail) text() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(tailText(t.buf, t.max))
}
