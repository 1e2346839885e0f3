package handlers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	// Cmd is the argv; Cmd[0] must be an absolute path on the allow list. Required.
	Cmd []string `json:"cmd"`
	// Env adds variables to the child's environment: LANG, TZ, LC_* and the names the worker
	// allows (see [Exec]).
	Env map[string]string `json:"env,omitempty"`
	// Dir is the working directory.
	Dir string `json:"dir,omitempty"`
	// Timeout, default 10m.
	Timeout Duration `json:"timeout,omitempty"`
}

// ErrExecDisabled fails exec jobs on a worker with no allow list.
var ErrExecDisabled = errors.New("exec handler is disabled on this worker: set WORKER_EXEC_ALLOW to the commands it may run")

// Exec runs an allow-listed command. allow holds absolute command paths (other entries never
// match); an empty list disables the handler (jobs fail permanently saying so). The payload's
// cmd[0] must be an absolute path too: a relative one would be looked up against the worker's
// directory when checked but against the job's dir when run. cmd[0] and the allow list are both
// compared with their symbolic links resolved, and the resolved file is what runs (with cmd[0]
// kept as the child's argv[0], for programs that look at the name they were called by).
//
// The child runs in its own process group with a small environment (PATH, HOME, LANG, TZ, the
// payload's env) plus LEASH_JOB_ID, LEASH_LEASE_TOKEN and LEASH_ATTEMPT; the worker's own
// variables (DATABASE_URL...) are not passed on. The payload's env is held to an allow list:
// LANG, TZ, LC_* and the names matching envAllow (exact names, or prefixes ending in "*"; "*"
// alone matches every name), and never the names [EnvDenied] refuses, which make the command
// load or run other code or send its traffic elsewhere, whatever envAllow says. An allow list,
// because the variables that change what a program does are too many to list: a job that may
// set only what the operator chose cannot reach the ones nobody thought of. A job setting any
// other name fails permanently with an error naming the variable.
//
// When the job's context ends (revoked, lease lost, shutdown) or its timeout passes, the group
// gets SIGTERM, then SIGKILL after grace, and whatever is left in the group is killed once the
// command has exited. A descendant that leaves the group (setsid, setpgid: daemons do) is out of
// reach and keeps running: run such commands under a supervisor of their own. A non-zero exit
// fails the attempt with the exit code and the output's tail (at most 2 kB, valid UTF-8, NUL
// bytes replaced). Kind "exec".
func Exec(allow []string, grace time.Duration, envAllow ...string) pool.Handler {
	if grace <= 0 {
		grace = ExecGraceDefault
	}
	var allowed []string
	for _, a := range allow {
		if a = strings.TrimSpace(a); filepath.IsAbs(a) {
			allowed = append(allowed, filepath.Clean(a))
		}
	}
	envOK := envAllowList(envAllow)
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
		if err := checkEnv(a.Env, envOK); err != nil {
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

// resolve checks the command against the allow list, both with symbolic links resolved, and
// returns the resolved path: the file that was checked is the file that runs, wherever the job's
// dir is. Only absolute paths are accepted. The allow list is resolved on every call, so an entry
// that is a link (a package manager's alternatives) follows the link's current target.
func resolve(name string, allowed []string) (string, error) {
	if !filepath.IsAbs(name) {
		return "", fmt.Errorf("exec: cmd[0] %s must be an absolute path", quoteName(name))
	}
	clean := filepath.Clean(name)
	target, rerr := filepath.EvalSymlinks(clean)
	ok := false
	for _, a := range allowed {
		if rerr == nil {
			if ra, err := filepath.EvalSymlinks(a); err == nil && ra == target {
				ok = true
				break
			}
		}
		if a == clean { // listed as given: a missing file is reported as such below
			ok = true
			break
		}
	}
	if !ok {
		return "", fmt.Errorf("exec: %s is not in WORKER_EXEC_ALLOW", quoteName(name))
	}
	if rerr != nil {
		return "", fmt.Errorf("exec: %s: %w", quoteName(name), rerr)
	}
	if _, err := exec.LookPath(target); err != nil { // a regular file with an execute bit
		return "", fmt.Errorf("exec: %s: %w", quoteName(name), err)
	}
	return target, nil
}

func runChild(ctx context.Context, job *pool.Job, path string, a ExecArgs, timeout, grace time.Duration) error {
	cmd := exec.Command(path, a.Cmd[1:]...)
	cmd.Args[0] = a.Cmd[0] // the name it was called by; path is what runs
	cmd.Dir = a.Dir
	cmd.Env = childEnv(job, a.Env)
	out := &tail{max: execTailBytes}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", a.Cmd[0], err)
	}
	pgid := cmd.Process.Pid
	log := pool.Logger(ctx).With(slog.String("cmd", a.Cmd[0]), slog.Int("pid", pgid))
	log.DebugContext(ctx, "command started")
	started := time.Now()
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
		log.InfoContext(ctx, "stopping command: SIGTERM to its process group", slog.Any("cause", stopped), slog.Duration("grace", grace))
		syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case err = <-done:
		case <-time.After(grace):
			log.WarnContext(ctx, "command outlived its grace period: SIGKILL to its process group")
			syscall.Kill(-pgid, syscall.SIGKILL)
			err = <-done
		}
	}
	log.DebugContext(ctx, "command ended", slog.Int("exit_code", cmd.ProcessState.ExitCode()), slog.Duration("took", time.Since(started)))
	// Whatever the child left behind in its group goes too.
	syscall.Kill(-pgid, syscall.SIGKILL)
	if stopped != nil {
		return stopped
	}
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			job.SetOutput(ExecOutput{ExitCode: ee.ExitCode(), Tail: out.text()})
			return fmt.Errorf("exec %s: exit code %d: %s", a.Cmd[0], ee.ExitCode(), out.text())
		}
		return fmt.Errorf("exec %s: %w", a.Cmd[0], err)
	}
	job.SetOutput(ExecOutput{ExitCode: 0, Tail: out.text()})
	return nil
}

// ExecOutput is what the exec handler records as a job's output when the command ran to its
// end: its exit code and the tail of its combined stdout and stderr (at most 2 kB, valid UTF-8
// without NUL).
type ExecOutput struct {
	ExitCode int    `json:"exit_code"`
	Tail     string `json:"tail"`
}

// EnvDenied says why the payload's env may never set name ("" when it is not denied; whether it
// may then depends on the allow list, see [Exec]). Denied whatever the allow list says: names
// that are not [A-Za-z_][A-Za-z0-9_]*; PATH and HOME (the worker's own are passed on: a job
// choosing them chooses which programs and startup files run) and LEASH_* (set by the worker);
// variables that make the dynamic loader, a shell, an interpreter or a tool load or run other
// code or read other configuration (LD_*, DYLD_*, BASH_FUNC_*, GIT_*, OPENSSL_*, npm_config_*,
// XDG_CONFIG_*, BASH_ENV, ENV, IFS, PYTHONSTARTUP, PERL5OPT, NODE_OPTIONS, RSYNC_RSH, VIMINIT,
// PSQLRC, CURL_HOME, MAKEFLAGS, TAR_OPTIONS, KUBECONFIG and the like); proxies (HTTP_PROXY,
// https_proxy, ALL_PROXY, NO_PROXY...), which send the command's traffic elsewhere; and
// variables that change which certificates are trusted or where TLS secrets go (SSL_CERT_FILE,
// SSLKEYLOGFILE...). Names are compared ignoring case, since some programs read them so. The
// full list is in this package's source, beside this function.
func EnvDenied(name string) string {
	if !validEnvName(name) {
		return "not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
	}
	upper := strings.ToUpper(name)
	for _, p := range envDeniedPrefixes {
		if strings.HasPrefix(upper, p.prefix) {
			return p.why
		}
	}
	if why, ok := envDeniedNames[upper]; ok {
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
	whyLoader  = "changes what the dynamic loader or libc loads"
	whyShell   = "makes a shell run other code"
	whyInterp  = "makes an interpreter load or run other code"
	whyTool    = "makes a tool run another program"
	whyConfig  = "makes a program read other configuration or startup files"
	whyGit     = "makes git run other programs or read other repositories and configuration"
	whyOpenSSL = "makes OpenSSL load other configuration or modules"
	whyProxy   = "sends the command's traffic through another host"
	whyTLS     = "changes which certificates are trusted or where TLS secrets are written"
	whyWorker  = "set by the worker"
	whyNotOn   = "not on the exec handler's env allow list (LANG, TZ, LC_* and the names the worker allows)"
)

// envDeniedPrefixes and envDeniedNames are upper case; names are compared in upper case.
var envDeniedPrefixes = []struct{ prefix, why string }{
	{"LD_", whyLoader}, {"DYLD_", whyLoader}, {"BASH_FUNC_", whyShell}, {"GIT_", whyGit}, {"OPENSSL_", whyOpenSSL},
	{"NPM_CONFIG_", whyConfig}, {"XDG_CONFIG_", whyConfig}, {"XDG_DATA_", whyConfig}, {"LEASH_", whyWorker},
}

var envDeniedNames = map[string]string{
	"PATH": whyWorker, "HOME": whyWorker,
	"GCONV_PATH": whyLoader, "LOCPATH": whyLoader, "GLIBC_TUNABLES": whyLoader, "MALLOC_CONF": whyLoader, "NLSPATH": whyLoader,
	"HOSTALIASES": whyLoader, "LOCALDOMAIN": whyLoader, "RES_OPTIONS": whyLoader, "RESOLV_HOST_CONF": whyLoader,
	"BASH_ENV": whyShell, "ENV": whyShell, "IFS": whyShell, "CDPATH": whyShell, "SHELLOPTS": whyShell,
	"BASHOPTS": whyShell, "PS4": whyShell, "PROMPT_COMMAND": whyShell, "GLOBIGNORE": whyShell, "ZDOTDIR": whyShell,
	"INPUTRC":       whyShell,
	"PYTHONSTARTUP": whyInterp, "PYTHONPATH": whyInterp, "PYTHONHOME": whyInterp, "PYTHONINSPECT": whyInterp,
	"PYTHONWARNINGS": whyInterp, "PYTHONBREAKPOINT": whyInterp, "PYTHONUSERBASE": whyInterp, "PYTHONSAFEPATH": whyInterp,
	"PERL5OPT": whyInterp, "PERL5LIB": whyInterp, "PERLLIB": whyInterp, "PERL5DB": whyInterp,
	"RUBYOPT": whyInterp, "RUBYLIB": whyInterp, "GEM_HOME": whyInterp, "GEM_PATH": whyInterp, "BUNDLE_GEMFILE": whyInterp,
	"NODE_OPTIONS": whyInterp, "NODE_PATH": whyInterp,
	"JAVA_TOOL_OPTIONS": whyInterp, "_JAVA_OPTIONS": whyInterp, "JDK_JAVA_OPTIONS": whyInterp, "CLASSPATH": whyInterp,
	"LUA_INIT": whyInterp, "LUA_PATH": whyInterp, "LUA_CPATH": whyInterp, "PHPRC": whyInterp, "PHP_INI_SCAN_DIR": whyInterp,
	"TCLLIBPATH": whyInterp, "R_PROFILE_USER": whyInterp, "R_ENVIRON_USER": whyInterp,
	"SSH_ASKPASS": whyTool, "SUDO_ASKPASS": whyTool, "PAGER": whyTool, "EDITOR": whyTool, "VISUAL": whyTool, "BROWSER": whyTool,
	"SHELL": whyTool, "LESSOPEN": whyTool, "LESSCLOSE": whyTool, "MANPAGER": whyTool, "SYSTEMD_PAGER": whyTool,
	"RSYNC_RSH": whyTool, "RSYNC_CONNECT_PROG": whyTool, "PSQL_PAGER": whyTool, "PSQL_EDITOR": whyTool,
	"MAKEFLAGS": whyTool, "GNUMAKEFLAGS": whyTool, "MFLAGS": whyTool, "MAKEFILES": whyTool, "TAR_OPTIONS": whyTool,
	"VIMINIT": whyConfig, "EXINIT": whyConfig, "MYVIMRC": whyConfig, "PSQLRC": whyConfig, "PGSERVICEFILE": whyConfig,
	"PGSYSCONFDIR": whyConfig, "CURL_HOME": whyConfig, "WGETRC": whyConfig, "GNUPGHOME": whyConfig, "KRB5_CONFIG": whyConfig,
	"KUBECONFIG": whyConfig, "DOCKER_CONFIG": whyConfig, "AWS_CONFIG_FILE": whyConfig, "AWS_SHARED_CREDENTIALS_FILE": whyConfig,
	"BOTO_CONFIG": whyConfig, "CLOUDSDK_CONFIG": whyConfig,
	"HTTP_PROXY": whyProxy, "HTTPS_PROXY": whyProxy, "ALL_PROXY": whyProxy, "NO_PROXY": whyProxy, "FTP_PROXY": whyProxy,
	"RSYNC_PROXY":   whyProxy,
	"SSLKEYLOGFILE": whyTLS, "SSL_CERT_FILE": whyTLS, "SSL_CERT_DIR": whyTLS, "CURL_CA_BUNDLE": whyTLS,
	"REQUESTS_CA_BUNDLE": whyTLS, "NODE_EXTRA_CA_CERTS": whyTLS,
}

// envAllow is the payload env's allow list: exact names and prefixes.
type envAllow struct {
	names    map[string]bool
	prefixes []string
}

// envAllowList is LANG, TZ and LC_* plus the operator's patterns: exact names, or prefixes
// ending in "*" ("*" alone matches every name). A pattern with "*" elsewhere matches nothing
// (see [CheckExecEnvAllow]).
func envAllowList(patterns []string) envAllow {
	e := envAllow{names: map[string]bool{"LANG": true, "TZ": true}, prefixes: []string{"LC_"}}
	for _, p := range patterns {
		p = strings.TrimSpace(p)
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			e.prefixes = append(e.prefixes, prefix)
		} else if p != "" {
			e.names[p] = true
		}
	}
	return e
}

func (e envAllow) allows(name string) bool {
	if e.names[name] {
		return true
	}
	for _, p := range e.prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// CheckExecEnvAllow reports the first pattern of an exec env allow list (Options.ExecEnvAllow)
// that can match nothing: an empty pattern, or one that is not a variable name with at most a
// trailing "*". Patterns are case-sensitive.
func CheckExecEnvAllow(patterns []string) error {
	for _, p := range patterns {
		name, wild := strings.CutSuffix(strings.TrimSpace(p), "*")
		if (name == "" && !wild) || (name != "" && !validEnvName(name)) {
			return fmt.Errorf("exec env allow list: %s must be a variable name, optionally ending in * to match any rest", quoteName(p))
		}
	}
	return nil
}

// checkEnv refuses the payload's env when a name is denied or not allowed, or a value holds a
// NUL byte; the error names the first offending variable (in sorted order).
func checkEnv(env map[string]string, allow envAllow) error {
	for _, k := range slices.Sorted(maps.Keys(env)) {
		why := EnvDenied(k)
		if why == "" && !allow.allows(k) {
			why = whyNotOn
		}
		if why != "" {
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
