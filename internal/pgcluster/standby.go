package pgcluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// StartStandby creates a streaming standby of primary (pg_basebackup -R: a copy of its data
// directory that follows its WAL) in a new temporary directory, named name in the primary's
// pg_stat_replication (its application_name, what synchronous_standby_names refers to), and
// starts it. settings are extra settings of the standby, written after the ones copied from the
// primary's postgresql.auto.conf (which pg_basebackup copies too: a primary's
// synchronous_standby_names would otherwise make the promoted standby wait for a standby of its
// own). Call Close to stop it and remove its files; Promote makes it a primary.
func StartStandby(ctx context.Context, primary *Cluster, name string, settings ...string) (*Cluster, error) {
	dir, err := os.MkdirTemp("", "leash-pg-standby-")
	if err != nil {
		return nil, fmt.Errorf("create standby directory: %w", err)
	}
	c := &Cluster{dir: dir, binDir: primary.binDir, cred: primary.cred, logPath: filepath.Join(dir, "postgres.log")}
	if c.cred != nil {
		if err := os.Chown(dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("chown standby directory: %w", err)
		}
	}
	backup := exec.CommandContext(ctx, c.tool("pg_basebackup"), "-h", "127.0.0.1", "-p", strconv.Itoa(primary.Port),
		"-U", "postgres", "-D", c.dataDir(), "-R", "-X", "stream", "--no-sync", "-d", "application_name="+name)
	backup.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGKILL}
	if out, err := backup.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pg_basebackup: %w: %s", err, out)
	}
	conf := append([]string{"unix_socket_directories = '" + dir + "'"}, settings...)
	f, err := os.OpenFile(filepath.Join(c.dataDir(), "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(strings.Join(conf, "\n") + "\n")
		f.Close()
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("write standby settings: %w", err)
	}
	if c.Port, err = freePort(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := c.Restart(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Promote ends recovery on a standby (pg_ctl promote) and waits until it accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, c.tool("pg_ctl"), "promote", "-w", "-t", "60", "-D", c.dataDir())
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGKILL}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl promote: %w: %s", err, out)
	}
	return nil
}

// tool returns the path of one of the server's programs: next to postgres as found, else next to
// what postgres links to (a PATH of symlinks to some of them), else on PATH.
func (c *Cluster) tool(name string) string {
	if p := filepath.Join(c.binDir, name); fileExists(p) {
		return p
	}
	if real, err := filepath.EvalSymlinks(filepath.Join(c.binDir, "postgres")); err == nil {
		if p := filepath.Join(filepath.Dir(real), name); fileExists(p) {
			return p
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	return name
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
