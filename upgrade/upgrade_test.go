package upgrade_test

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// release is one entry of CHANGELOG.md.
type release struct {
	Version string
	Date    string
	// Commit names the commit the release is cut from; "HEAD" for the tree under test, until
	// its tag names a commit.
	Commit string
}

var (
	headingRe = regexp.MustCompile(`^## \[([^\]]+)\](?:\s+-\s+(\d{4}-\d{2}-\d{2}))?(.*)$`)
	commitRe  = regexp.MustCompile("(?i)\\bcommit:?\\s+`?([0-9a-f]{7,40}|HEAD)\\b")
	semverRe  = regexp.MustCompile(`^(\d+)\.(\d+)\.(\d+)$`)
)

// parseChangelog reads the releases of a Keep a Changelog file, newest first. Each release
// names its commit in its heading or in a "commit: ..." line of its section.
func parseChangelog(text string) ([]release, error) {
	var out []release
	var cur *release
	end := func() error {
		if cur != nil && cur.Commit == "" {
			return fmt.Errorf("release %s names no commit (a line `commit: <hash>` under its heading)", cur.Version)
		}
		return nil
	}
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, "\r\n")
		if m := headingRe.FindStringSubmatch(line); m != nil {
			if err := end(); err != nil {
				return nil, err
			}
			cur = nil
			if strings.EqualFold(m[1], "unreleased") {
				continue
			}
			if !semverRe.MatchString(m[1]) || m[2] == "" {
				return nil, fmt.Errorf("heading %q: want ## [X.Y.Z] - YYYY-MM-DD", line)
			}
			out = append(out, release{Version: m[1], Date: m[2]})
			cur = &out[len(out)-1]
			if c := commitRe.FindStringSubmatch(m[3]); c != nil {
				cur.Commit = c[1]
			}
			continue
		}
		if strings.HasPrefix(line, "## ") {
			if err := end(); err != nil {
				return nil, err
			}
			cur = nil
			continue
		}
		if cur != nil && cur.Commit == "" && strings.HasPrefix(strings.ToLower(strings.TrimSpace(line)), "commit") {
			if c := commitRe.FindStringSubmatch(line); c != nil {
				cur.Commit = c[1]
			}
		}
	}
	if err := end(); err != nil {
		return nil, err
	}
	return out, nil
}

func TestParseChangelog(t *testing.T) {
	rels, err := parseChangelog("# Changelog\n\n## [Unreleased]\n\n## [0.3.0] - 2027-01-02\n\ncommit: `HEAD` (the tag names it)\n\n" +
		"### Added\n- commit messages are not commits\n\n## [0.2.0] - 2026-11-30 — commit 0123abcd\n\n## [0.1.0] - 2026-11-29\n\nCommit: 1fe5ed1\n\n[0.1.0]: https://example.com\n")
	want := []release{{"0.3.0", "2027-01-02", "HEAD"}, {"0.2.0", "2026-11-30", "0123abcd"}, {"0.1.0", "2026-11-29", "1fe5ed1"}}
	if err != nil || fmt.Sprint(rels) != fmt.Sprint(want) {
		t.Fatalf("got %v, %v; want %v", rels, err, want)
	}
	if _, err := parseChangelog("## [0.1.0] - 2026-11-29\n\nNo commit here.\n"); err == nil {
		t.Fatal("a release without a commit accepted")
	}
}

// CHANGELOG.md lists this release first, and every release names its commit.
func TestChangelogNamesThisRelease(t *testing.T) {
	rels := changelog(t, repoRoot(t))
	if len(rels) == 0 || rels[0].Version != pool.Release {
		t.Fatalf("CHANGELOG.md's newest release is %v; pool.Release says %s", rels[:min(1, len(rels))], pool.Release)
	}
	for i := 1; i < len(rels); i++ {
		if rels[i].Commit == "HEAD" {
			t.Errorf("release %s is older than %s but names HEAD as its commit", rels[i].Version, rels[0].Version)
		}
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}

func changelog(t *testing.T, root string) []release {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	rels, err := parseChangelog(string(b))
	if err != nil {
		t.Fatalf("CHANGELOG.md: %v", err)
	}
	return rels
}

// unavailable skips the test, or fails it under LEASH_REQUIRE_UPGRADE=1 (for CI, whose clone
// must then carry the history).
func unavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("LEASH_REQUIRE_UPGRADE") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg + "; set LEASH_REQUIRE_UPGRADE=1 to make this a failure")
}

func git(root string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-C", root}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// goBuild builds dir's ./cmd/worker into bin: a package of the root module in early releases, a
// module of its own (with OpenTelemetry) in later ones.
func goBuild(dir, bin string, env ...string) error {
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/worker")
	if _, err := os.Stat(filepath.Join(dir, "cmd", "worker", "go.mod")); err == nil {
		cmd = exec.Command("go", "build", "-o", bin, ".")
		dir = filepath.Join(dir, "cmd", "worker")
	}
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build in %s: %w\n%s", dir, err, out)
	}
	return nil
}

// extract writes commit's tree into dir, as `git archive <commit> | tar -x -C dir` would.
func extract(root, commit, dir string) error {
	cmd := exec.Command("git", "-C", root, "archive", "--format=tar", commit)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	tr := tar.NewReader(out)
	var werr error
	for werr == nil {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			werr = err
			break
		}
		name := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(name, filepath.Clean(dir)+string(os.PathSeparator)) {
			werr = fmt.Errorf("archive entry %q outside the tree", h.Name)
			break
		}
		switch h.Typeflag {
		case tar.TypeDir:
			werr = os.MkdirAll(name, 0o755)
		case tar.TypeReg:
			if werr = os.MkdirAll(filepath.Dir(name), 0o755); werr == nil {
				var f *os.File
				if f, werr = os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&0o777|0o600); werr == nil {
					_, werr = io.Copy(f, tr)
					werr = errors.Join(werr, f.Close())
				}
			}
		case tar.TypeSymlink:
			werr = os.Symlink(h.Linkname, name)
		}
	}
	io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("git archive %s: %w: %s", commit, err, strings.TrimSpace(stderr.String()))
	}
	return werr
}

// TestRollingUpgrade upgrades a working fleet from every earlier release in CHANGELOG.md to
// this tree, the way docs/operations.md's Upgrading section says: the release's worker runs; this tree's
// `worker migrate` runs under it while jobs keep arriving; this tree's worker starts; the old one
// gets SIGTERM and hands back what it still runs. Every job must complete exactly once (attempt
// 1: a hand-back gives the attempt back, a lease lost or a failed attempt would not) and neither
// worker may log an error.
func TestRollingUpgrade(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	rels := changelog(t, root)
	if _, err := exec.LookPath("git"); err != nil {
		unavailable(t, "git is not installed: the upgrade test builds earlier releases from git history")
	}
	if _, err := git(root, "rev-parse", "--git-dir"); err != nil {
		unavailable(t, "%s is not a git checkout (%v): the upgrade test builds earlier releases from git history", root, err)
	}
	shallow, _ := git(root, "rev-parse", "--is-shallow-repository")

	type build struct {
		bin string
		err error
	}
	head := make(chan build, 1)
	go func() {
		bin := filepath.Join(t.TempDir(), "worker-head")
		head <- build{bin, goBuild(root, bin)}
	}()
	var headOnce sync.Once
	var headBin build
	headWorker := func(t *testing.T) string {
		headOnce.Do(func() { headBin = <-head })
		if headBin.err != nil {
			t.Fatal(headBin.err)
		}
		return headBin.bin
	}

	headCommit, err := git(root, "rev-parse", "HEAD")
	if err != nil {
		unavailable(t, "%s has no HEAD commit: %v", root, err)
	}
	ran := 0
	for _, r := range rels {
		if r.Commit == "HEAD" {
			t.Logf("release %s names HEAD as its commit: it is the tree under test; no upgrade from it", r.Version)
			continue
		}
		t.Run(r.Version, func(t *testing.T) {
			commit, err := git(root, "rev-parse", "--verify", "--quiet", r.Commit+"^{commit}")
			if err != nil {
				if shallow == "true" {
					unavailable(t, "release %s's commit %s is not in this shallow clone (git fetch --unshallow)", r.Version, r.Commit)
				}
				unavailable(t, "release %s's commit %s is not in this repository's history", r.Version, r.Commit)
			}
			if commit == headCommit {
				t.Skipf("release %s's commit %s is HEAD, the tree under test; no upgrade from it", r.Version, r.Commit)
			}
			if _, err := git(root, "diff", "--quiet", commit, "--", "*.go", "go.mod", "go.sum", "sql"); err == nil {
				t.Skipf("release %s (%s) has the code of the tree under test", r.Version, r.Commit)
			}
			src := t.TempDir()
			if err := extract(root, commit, src); err != nil {
				t.Fatal(err)
			}
			same, err := sameMigrations(filepath.Join(src, "sql"), filepath.Join(root, "sql"))
			if err != nil {
				t.Fatal(err)
			}
			if same {
				t.Skipf("release %s (%s) has the migrations of the tree under test: its upgrade migrates nothing; no upgrade from it", r.Version, r.Commit)
			}
			oldBin := filepath.Join(t.TempDir(), "worker-"+r.Version)
			// Its own go.mod and go.sum, as released; the module cache serves the dependencies.
			// A release with a go.work builds its binary against its own library through it (its
			// go.mod requires a version of the library the module proxy may not have); an older
			// one replaced the library by its own tree in cmd/worker/go.mod.
			env := []string{"GOFLAGS=-mod=mod -buildvcs=false", "GOWORK=off"}
			if _, err := os.Stat(filepath.Join(src, "go.work")); err == nil {
				env = []string{"GOFLAGS=-buildvcs=false", "GOWORK=" + filepath.Join(src, "go.work")}
			}
			if err := goBuild(src, oldBin, env...); err != nil {
				t.Fatal(err)
			}
			rollingUpgrade(t, r, oldBin, headWorker(t))
		})
		ran++
	}
	if ran == 0 {
		t.Log("CHANGELOG.md lists no release older than this tree")
	}
}

// sameMigrations reports whether the directories a and b hold the same migrations: the same
// *.sql files with the same contents. A missing directory holds none.
func sameMigrations(a, b string) (bool, error) {
	read := func(dir string) (map[string]string, error) {
		files, err := filepath.Glob(filepath.Join(dir, "*.sql"))
		if err != nil {
			return nil, err
		}
		m := map[string]string{}
		for _, f := range files {
			body, err := os.ReadFile(f)
			if err != nil {
				return nil, fmt.Errorf("migrations: %w", err)
			}
			m[filepath.Base(f)] = string(body)
		}
		return m, nil
	}
	ma, err := read(a)
	if err != nil {
		return false, err
	}
	mb, err := read(b)
	if err != nil {
		return false, err
	}
	return len(ma) > 0 && maps.Equal(ma, mb), nil
}

// A release cut from the tree under test, or from a commit with its migrations, is not
// upgraded from: sameMigrations tells them from earlier ones.
func TestSameMigrations(t *testing.T) {
	t.Parallel()
	dirs := map[string]map[string]string{
		"release": {"001_jobs.sql": "CREATE TABLE a ();", "002_more.sql": "CREATE TABLE b ();"},
		"tree":    {"001_jobs.sql": "CREATE TABLE a ();", "002_more.sql": "CREATE TABLE b ();"},
		"newer":   {"001_jobs.sql": "CREATE TABLE a ();", "002_more.sql": "CREATE TABLE b ();", "003_new.sql": "SELECT;"},
		"edited":  {"001_jobs.sql": "CREATE TABLE a ();", "002_more.sql": "CREATE TABLE c ();"},
		"empty":   {},
	}
	base := t.TempDir()
	for name, files := range dirs {
		if err := os.MkdirAll(filepath.Join(base, name), 0o755); err != nil {
			t.Fatal(err)
		}
		for f, body := range files {
			if err := os.WriteFile(filepath.Join(base, name, f), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, c := range []struct {
		a, b string
		want bool
	}{{"release", "tree", true}, {"release", "newer", false}, {"release", "edited", false},
		{"empty", "empty", false}, {"missing", "tree", false}} {
		got, err := sameMigrations(filepath.Join(base, c.a), filepath.Join(base, c.b))
		if err != nil || got != c.want {
			t.Errorf("sameMigrations(%s, %s) = %v, %v; want %v", c.a, c.b, got, err, c.want)
		}
	}
	// This tree against itself, as a release cut from it is.
	root := repoRoot(t)
	if same, err := sameMigrations(filepath.Join(root, "sql"), filepath.Join(root, "sql")); err != nil || !same {
		t.Errorf("this tree's migrations differ from themselves: %v, %v", same, err)
	}
}

// process is a worker process and its JSON log.
type process struct {
	name string
	cmd  *exec.Cmd
	logs syncbuf.Buffer
	done chan struct{}
	err  error // set before done is closed
}

func startWorker(t *testing.T, name, bin string, env ...string) *process {
	t.Helper()
	p := &process{name: name, done: make(chan struct{})}
	p.cmd = exec.Command(bin, "run")
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stderr = &p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// lines returns the log's lines at level (ERROR, WARN...).
func (p *process) lines(level string) []string {
	var out []string
	for line := range strings.Lines(p.logs.String()) {
		var l struct{ Level string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Level == level {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}

// counts is the jobs table by state.
type counts map[string]int

func (c counts) final() int { return c["completed"] + c["failed"] + c["cancelled"] }

func (c counts) total() (n int) {
	for _, v := range c {
		n += v
	}
	return n
}

func stateCounts(t *testing.T, db *pgxpool.Pool) counts {
	t.Helper()
	rows, err := db.Query(context.Background(), "SELECT state, count(*) FROM leash.jobs GROUP BY state")
	if err != nil {
		t.Fatal(err)
	}
	c := counts{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			t.Fatal(err)
		}
		c[s] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return c
}

func rollingUpgrade(t *testing.T, r release, oldBin, newBin string) {
	ctx := context.Background()
	began := time.Now()
	url := pgtest.EmptyURL(t)
	db := pgtest.PoolFor(t, url)
	var workers []*process
	t.Cleanup(func() {
		if t.Failed() {
			for _, p := range workers {
				t.Logf("%s worker's log:\n%s", p.name, p.logs.String())
			}
		}
	})
	// waitFor polls the database for what no signal reports: other processes' progress.
	waitFor := func(timeout time.Duration, what string, cond func(counts) bool) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for {
			c := stateCounts(t, db)
			if cond(c) {
				return
			}
			for _, p := range workers {
				if p.exited() && p.cmd.ProcessState != nil && p.name == "old" && !p.cmd.ProcessState.Success() {
					t.Fatalf("waiting for %s: the %s worker exited: %v", what, p.name, p.err)
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("timed out after %s waiting for %s; jobs by state: %v", timeout, what, c)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	migrate := func(bin string) string {
		t.Helper()
		cmd := exec.Command(bin, "migrate")
		cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "LOG_FORMAT=json")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s migrate: %v\n%s", bin, err, out)
		}
		return strings.TrimSpace(string(out))
	}

	// The release's schema, as its users have it.
	out := migrate(oldBin)
	before, err := store.CheckSchema(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("release %s: `worker migrate` said %q; schema at version %d", r.Version, out, before.Current)

	// Work: a few long jobs the old worker will hold at its shutdown (claimed first), and 200
	// short ones.
	const long, short = 4, 200
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, payload, priority)
		SELECT 'sleep', '{"duration":"8s"}', -1 FROM generate_series(1, $1)`, long); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, payload)
		SELECT 'sleep', jsonb_build_object('duration', (100 + (i * 37) % 201) || 'ms') FROM generate_series(1, $1) i`, short); err != nil {
		t.Fatal(err)
	}
	timing := []string{"DATABASE_URL=" + url, "LOG_FORMAT=json", "WORKER_LEASE_DURATION=2s",
		"WORKER_HEARTBEAT_INTERVAL=500ms", "WORKER_POLL_INTERVAL=100ms", "WORKER_SHUTDOWN_TIMEOUT=1s"}
	old := startWorker(t, "old", oldBin, append(timing, "WORKER_ID=old", "WORKER_CONCURRENCY=8")...)
	workers = append(workers, old)
	waitFor(30*time.Second, "the old worker to complete 20 jobs", func(c counts) bool { return c["completed"] >= 20 })

	// Producers keep inserting, one job per transaction, through the migration.
	stopInserts := make(chan struct{})
	var inserted atomic.Int64
	insertErr := make(chan error, 1)
	go func() {
		defer close(insertErr)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopInserts:
				return
			case <-tick.C:
			}
			if _, err := db.Exec(ctx, `INSERT INTO leash.jobs (kind, payload) VALUES ('sleep', '{"duration":"100ms"}')`); err != nil {
				insertErr <- err
				return
			}
			inserted.Add(1)
		}
	}()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			close(stopInserts)
			if err := <-insertErr; err != nil {
				t.Fatalf("insert during the upgrade: %v", err)
			}
		}
	}
	defer stop()

	// This tree's migrations, under the working old worker.
	atMigrate := stateCounts(t, db)["completed"]
	migStart := time.Now()
	out = migrate(newBin)
	migTook := time.Since(migStart)
	after, err := store.CheckSchema(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if after.Behind() || after.Current != store.ExpectedVersion() {
		t.Fatalf("after this tree's migrate (%q): %+v", out, after)
	}
	t.Logf("this tree's `worker migrate` took %s with the old worker running (%d jobs completed before): %q",
		migTook.Round(time.Millisecond), atMigrate, out)

	// The old worker goes on alone on the new schema.
	done := stateCounts(t, db)["completed"]
	waitFor(30*time.Second, "the old worker to complete 16 more jobs on the migrated schema", func(c counts) bool { return c["completed"] >= done+16 })
	if old.exited() {
		t.Fatalf("the old worker exited: %v", old.err)
	}

	// This tree's worker joins; the old one is stopped.
	nw := startWorker(t, "new", newBin, append(timing, "WORKER_ID=new")...)
	workers = append(workers, nw)
	poll := func(timeout time.Duration, what string, query string) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for {
			var ok bool
			if err := db.QueryRow(ctx, query).Scan(&ok); err != nil {
				t.Fatal(err)
			}
			if ok {
				return
			}
			if nw.exited() {
				t.Fatalf("waiting for %s: the new worker exited: %v", what, nw.err)
			}
			if time.Now().After(deadline) {
				t.Fatalf("timed out after %s waiting for %s; jobs by state: %v", timeout, what, stateCounts(t, db))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	poll(30*time.Second, "the new worker to claim jobs", `SELECT EXISTS (SELECT FROM leash.jobs WHERE leased_by = 'new')`)
	stop()
	var heldLong int
	db.QueryRow(ctx, `SELECT count(*) FROM leash.jobs WHERE leased_by = 'old' AND payload->>'duration' = '8s'`).Scan(&heldLong)
	sigterm := time.Now()
	old.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-old.done:
		if old.err != nil {
			t.Fatalf("the old worker's exit after SIGTERM: %v", old.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the old worker did not exit within 20s of SIGTERM (shutdown timeout 1s)")
	}
	t.Logf("the old worker stopped %s after SIGTERM, holding %d of the %d long jobs (handed back to the new worker)",
		time.Since(sigterm).Round(time.Millisecond), heldLong, long)

	total := long + short + int(inserted.Load())
	waitFor(45*time.Second, fmt.Sprintf("all %d jobs to finish", total), func(c counts) bool { return c.total() == total && c.final() == total })

	rows, err := db.Query(ctx, `SELECT id, state, attempt, errors::text FROM leash.jobs
		WHERE state <> 'completed' OR attempt <> 1 OR errors <> '[]' ORDER BY id LIMIT 20`)
	if err != nil {
		t.Fatal(err)
	}
	var bad []string
	for rows.Next() {
		var id int64
		var state, errs string
		var attempt int
		if err := rows.Scan(&id, &state, &attempt, &errs); err != nil {
			t.Fatal(err)
		}
		bad = append(bad, fmt.Sprintf("job %d: %s at attempt %d, errors %s", id, state, attempt, errs))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(bad) > 0 {
		t.Errorf("jobs not completed exactly once (first 20):\n%s", strings.Join(bad, "\n"))
	}

	nw.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-nw.done:
		if nw.err != nil {
			t.Errorf("the new worker's exit after SIGTERM: %v", nw.err)
		}
	case <-time.After(20 * time.Second):
		t.Error("the new worker did not exit within 20s of SIGTERM")
	}
	for _, p := range workers {
		if lines := p.lines("ERROR"); len(lines) > 0 {
			t.Errorf("the %s worker logged errors:\n%s", p.name, strings.Join(lines, "\n"))
		}
		if lines := p.lines("WARN"); len(lines) > 0 {
			t.Logf("the %s worker's warnings:\n%s", p.name, strings.Join(lines, "\n"))
		}
	}
	t.Logf("%d jobs (%d inserted during the upgrade) completed once each; %s in all",
		total, inserted.Load(), time.Since(began).Round(time.Millisecond))
}
