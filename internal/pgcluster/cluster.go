// Package pgcluster starts private, throwaway PostgreSQL clusters from the locally installed
// server binaries: for tests, fault injection and `worker demo`. When running as root it drops to
// the postgres user, since PostgreSQL refuses to run as root.
//
// The library (internal/pgcluster, for its tests) and the worker binary's module
// (cmd/worker/internal/pgcluster, for `worker demo` and its tests) each have this file, the same
// to the byte: the binary's module may import no internal package of the library's.
// cmd/worker's TestCopiesMatchLibrary checks that they stay the same.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoServer means no PostgreSQL server binaries were found.
var ErrNoServer = errors.New("no PostgreSQL server binaries found (install the Debian/Ubuntu package \"postgresql\", or put initdb and postgres on PATH)")

// Cluster is a PostgreSQL server running from a temporary data directory.
type Cluster struct {
	// Port is the TCP port on 127.0.0.1.
	Port int

	dir     string
	binDir  string
	cred    *syscall.Credential
	logPath string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// FindBinDir returns the directory holding initdb and postgres: from PATH, else the newest
// /usr/lib/postgresql/*/bin.
func FindBinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if _, err := exec.LookPath("postgres"); err == nil {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "postgres")); err == nil {
			return d, nil
		}
	}
	return "", ErrNoServer
}

func version(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// Start creates a cluster in a new temporary directory and starts it. settings are extra
// `-c name=value` server settings. Call Close to stop it and remove its files.
func Start(ctx context.Context, settings ...string) (*Cluster, error) {
	binDir, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "leash-pg-")
	if err != nil {
		return nil, fmt.Errorf("create cluster directory: %w", err)
	}
	c := &Cluster{dir: dir, binDir: binDir, logPath: filepath.Join(dir, "postgres.log")}
	if os.Geteuid() == 0 {
		cred, err := postgresUser()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		c.cred = cred
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("chown cluster directory: %w", err)
		}
	}
	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"), "-D", c.dataDir(), "-U", "postgres",
		"--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGKILL}
	if out, err := initdb.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w: %s", err, out)
	}
	conf := []string{
		"listen_addresses = '127.0.0.1'",
		"unix_socket_directories = '" + dir + "'",
		"fsync = off", "synchronous_commit = off", "full_page_writes = off",
		"max_connections = 500", "shared_buffers = 128MB",
		"log_min_messages = warning", "logging_collector = off",
	}
	conf = append(conf, settings...)
	if err := os.WriteFile(filepath.Join(c.dataDir(), "postgresql.auto.conf"), []byte(strings.Join(conf, "\n")+"\n"), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("write settings: %w", err)
	}
	if c.cred != nil {
		os.Chown(filepath.Join(c.dataDir(), "postgresql.auto.conf"), int(c.cred.Uid), int(c.cred.Gid))
	}
	port, err := freePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	c.Port = port
	if err := c.Restart(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func postgresUser() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root needs a \"postgres\" user to run the server as: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (c *Cluster) dataDir() string { return filepath.Join(c.dir, "data") }

// URL returns a connection string for database on this cluster.
func (c *Cluster) URL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.Port, database)
}

// Restart starts the server if it is not running, and waits until it accepts connections.
func (c *Cluster) Restart(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		return nil
	}
	logf, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open server log: %w", err)
	}
	cmd := exec.Command(filepath.Join(c.binDir, "postgres"), "-D", c.dataDir(), "-p", strconv.Itoa(c.Port))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start postgres: %w", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); logf.Close(); close(done) }()
	c.cmd, c.done = cmd, done
	deadline := time.Now().Add(60 * time.Second)
	for {
		conn, err := pgconn.Connect(ctx, c.URL("postgres")+"&connect_timeout=2")
		if err == nil {
			conn.Close(ctx)
			return nil
		}
		select {
		case <-done:
			c.cmd = nil
			return fmt.Errorf("postgres exited at start: %s", c.logTail())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres did not accept connections within a minute: %w; log: %s", err, c.logTail())
		}
	}
}

func (c *Cluster) logTail() string {
	b, _ := os.ReadFile(c.logPath)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// Stop shuts the server down with the given signal (SIGINT: fast, SIGQUIT: immediate,
// SIGKILL: crash) and waits for it to exit.
func (c *Cluster) Stop(sig syscall.Signal) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil {
		return
	}
	if sig == syscall.SIGKILL {
		// Kill the postmaster and every backend, as a crash would.
		syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
	} else {
		c.cmd.Process.Signal(sig)
	}
	<-c.done
	if sig == syscall.SIGKILL {
		// Backends notice the postmaster's death on their own; give them no say.
		syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
	}
	c.cmd = nil
}

// Close stops the server and removes its files.
func (c *Cluster) Close() {
	c.Stop(syscall.SIGQUIT)
	os.RemoveAll(c.dir)
}
