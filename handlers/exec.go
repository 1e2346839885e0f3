package handlers

import (
	"context"
	"errors"
	"fmt"
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
// LEASH_ATTEMPT; the worker's own variables (DATABASE_URL...) are not passed on. When the job's
// context ends (revoked, lease lost, shutdown) or its timeout passes, the group gets SIGTERM, then
// SIGKILL after grace. A non-zero exit fails the attempt with the exit code and the output's tail.
// Kind "exec".
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
			return fmt.Errorf("exec %s: exit code %d: %s", a.Cmd[0], ee.ExitCode(), out.String())
		}
		return fmt.Errorf("exec %s: %w", a.Cmd[0], err)
	}
	return nil
}

func childEnv(job *pool.Job, extra map[string]string) []string {
	var env []string
	for _, k := range []string{"PATH", "HOME", "LANG", "TZ"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	keys := make([]string, 0, len(extra))
	for k := range extra {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
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

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}
