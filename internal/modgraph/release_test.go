package modgraph_test

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/leashq/leash/pool"
)

// releaseVersion is the version the modules of this tree require each other at: the release
// being prepared.
const releaseVersion = "v0.3.0"

// published are the modules a release publishes, by directory in the tree.
var published = map[string]string{
	".":          "github.com/leashq/leash",
	"otel":       "github.com/leashq/leash/otel",
	"cmd/worker": "github.com/leashq/leash/cmd/worker",
}

// The limits of the module zip format (golang.org/x/mod/zip).
const (
	maxZipFile = 500 << 20 // the files of a module, uncompressed
	maxGoMod   = 16 << 20
	maxLicense = 16 << 20
)

// TestReleaseInstalls publishes this tree's modules at releaseVersion on a module proxy made of
// files, the way the module proxy serves a tagged release, and installs from it as a user would:
// `go install github.com/leashq/leash/cmd/worker@v0.3.0` gives a worker whose `worker version`
// names the release and this tree's schema, and `go get github.com/leashq/leash@v0.3.0` gives an
// application that builds with package pool and has none of the binary's dependencies in its
// module graph. Third-party modules come from the module cache (read as a proxy) or, failing
// that, the configured proxy; our own only from the files made here.
func TestReleaseInstalls(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command on PATH: the release test runs the go command")
	}
	lib := root(t)
	started := time.Now()
	proxy := t.TempDir()
	files := moduleFiles(t, lib)
	for dir, mod := range published {
		publish(t, proxy, mod, filepath.Join(lib, dir), files[dir])
	}

	// The environment of a user outside any checkout: no workspace; a module cache of its own,
	// so that no module cache (or later test run) keeps this tree's v0.3.0 as the release's;
	// -trimpath so that the build cache serves what other builds compiled of the third-party
	// modules; no checksum database for our own modules, which the public one does not have.
	cache := strings.TrimSpace(goCmd(t, lib, nil, "env", "GOMODCACHE"))
	upstream := strings.TrimSpace(goCmd(t, lib, nil, "env", "GOPROXY"))
	proxies := "file://" + filepath.ToSlash(proxy) + ",file://" + filepath.ToSlash(filepath.Join(cache, "cache", "download"))
	if upstream != "" && upstream != "off" {
		proxies += "," + upstream
	}
	gobin := t.TempDir()
	env := []string{
		"GOWORK=off", "GOPROXY=" + proxies, "GONOSUMDB=github.com/leashq/*", "GOFLAGS=-mod=mod -modcacherw -trimpath",
		"GOMODCACHE=" + t.TempDir(), "GOBIN=" + gobin, "GOPRIVATE=", "GONOPROXY=", "GOTOOLCHAIN=local",
	}

	// The binary.
	home := t.TempDir()
	writeFile(t, filepath.Join(home, "go.mod"), "module example.com/home\n\ngo 1.26.8\n")
	goCmd(t, home, env, "install", "github.com/leashq/leash/cmd/worker@"+releaseVersion)
	out, err := exec.Command(filepath.Join(gobin, "worker"), "version").CombinedOutput()
	if err != nil {
		t.Fatalf("the installed worker's version: %v\n%s", err, out)
	}
	t.Logf("installed worker version:\n%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if lines[0] != "worker "+releaseVersion {
		t.Errorf("the installed worker says %q, want %q", lines[0], "worker "+releaseVersion)
	}
	if want := fmt.Sprintf("schema version %d", pool.SchemaVersion()); lines[len(lines)-1] != want {
		t.Errorf("the installed worker says %q, want %q (this tree's)", lines[len(lines)-1], want)
	}

	// The library, in an application.
	app := t.TempDir()
	writeFile(t, filepath.Join(app, "go.mod"), "module example.com/app\n\ngo 1.26.8\n")
	writeFile(t, filepath.Join(app, "main.go"), `package main

import (
	"fmt"

	"github.com/leashq/leash/pool"
)

func main() { fmt.Println(pool.Release, pool.SchemaVersion()) }
`)
	goCmd(t, app, env, "get", "github.com/leashq/leash@"+releaseVersion)
	goCmd(t, app, env, "build", "-o", filepath.Join(t.TempDir(), "app"), ".")
	mods := goCmd(t, app, env, "list", "-m", "all")
	if !strings.Contains(mods, "github.com/leashq/leash "+releaseVersion+"\n") {
		t.Errorf("the application's module graph lacks github.com/leashq/leash %s:\n%s", releaseVersion, mods)
	}
	for _, line := range strings.Split(mods, "\n") {
		for _, f := range []string{"github.com/chromedp/", "github.com/prometheus/", "go.opentelemetry.io/"} {
			if strings.HasPrefix(line, f) {
				t.Errorf("an application that gets the library gets %s", line)
			}
		}
	}
	t.Logf("published %d modules, installed the worker and built an application in %s", len(published), time.Since(started).Round(time.Millisecond))
}

// The files that go into each module's zip: every file of the module's directory but those of
// a nested module, of version control, and of vendor directories.
func TestModuleZipFiles(t *testing.T) {
	t.Parallel()
	files := moduleFiles(t, root(t))
	for dir, want := range map[string][]string{
		".":          {"go.mod", "go.sum", "pool/pool.go", "sql/001_jobs.sql", "CHANGELOG.md"},
		"otel":       {"go.mod", "go.sum", "otel.go"},
		"cmd/worker": {"go.mod", "go.sum", "main.go", "internal/web/templates/job.html"},
	} {
		for _, f := range want {
			if !slices.Contains(files[dir], f) {
				t.Errorf("module %s lacks %s", dir, f)
			}
		}
		for _, f := range files[dir] {
			if strings.HasPrefix(f, ".git/") || (dir == "." && (strings.HasPrefix(f, "otel/") ||
				strings.HasPrefix(f, "cmd/worker/") || strings.HasPrefix(f, "bench/"))) {
				t.Errorf("module %s holds %s", dir, f)
			}
		}
	}
}

// moduleFiles returns the files of each module of the tree at lib, by module directory (slash
// separated, "." for the library), each path relative to its module's directory. The files are
// those git tracks or would (untracked but not ignored) when lib is a git checkout, else every
// file under lib; a file belongs to the module of the nearest directory above it with a go.mod.
func moduleFiles(t *testing.T, lib string) map[string][]string {
	t.Helper()
	var all []string
	if out, err := exec.Command("git", "-C", lib, "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output(); err == nil {
		for _, f := range strings.Split(string(out), "\x00") {
			if f != "" {
				all = append(all, f)
			}
		}
	} else {
		err := filepath.WalkDir(lib, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && (d.Name() == ".git" || d.Name() == ".hg" || d.Name() == ".svn" || d.Name() == ".bzr") {
				return filepath.SkipDir
			}
			if !d.IsDir() {
				rel, _ := filepath.Rel(lib, p)
				all = append(all, filepath.ToSlash(rel))
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	modules := map[string]bool{}
	for _, f := range all {
		if path.Base(f) == "go.mod" {
			modules[path.Dir(f)] = true
		}
	}
	out := map[string][]string{}
	for _, f := range all {
		dir := path.Dir(f)
		for !modules[dir] && dir != "." {
			dir = path.Dir(dir)
		}
		if !modules[dir] {
			continue
		}
		rel := f
		if dir != "." {
			rel = strings.TrimPrefix(f, dir+"/")
		}
		elems := strings.Split(rel, "/")
		if slices.ContainsFunc(elems[:len(elems)-1], func(e string) bool {
			return e == "vendor" || e == ".git" || e == ".hg" || e == ".svn" || e == ".bzr"
		}) {
			continue
		}
		info, err := os.Lstat(filepath.Join(lib, filepath.FromSlash(f)))
		if err != nil || !info.Mode().IsRegular() {
			continue // deleted in the working tree, or a link: not in a module zip
		}
		out[dir] = append(out[dir], rel)
	}
	for _, fs := range out {
		slices.Sort(fs)
	}
	return out
}

// publish writes module mod at releaseVersion, made of files (relative to dir), into the file
// proxy at proxy: its version list, .info, .mod and .zip, following the module zip format.
func publish(t *testing.T, proxy, mod, dir string, files []string) {
	t.Helper()
	at := filepath.Join(proxy, filepath.FromSlash(escapePath(mod)), "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	seen := map[string]string{}
	var total int64
	for _, f := range files {
		if err := checkFilePath(f); err != nil {
			t.Fatalf("module %s: %v", mod, err)
		}
		if other, ok := seen[strings.ToLower(f)]; ok {
			t.Fatalf("module %s: %s and %s differ only in case", mod, other, f)
		}
		seen[strings.ToLower(f)] = f
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(f)))
		if err != nil {
			t.Fatal(err)
		}
		total += int64(len(b))
		switch {
		case total > maxZipFile:
			t.Fatalf("module %s: its files are larger than %d bytes", mod, maxZipFile)
		case f == "go.mod" && len(b) > maxGoMod, f == "LICENSE" && len(b) > maxLicense:
			t.Fatalf("module %s: %s is larger than %d bytes", mod, f, maxGoMod)
		}
		w, err := zw.Create(mod + "@" + releaseVersion + "/" + f)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(b); err != nil {
			t.Fatal(err)
		}
		if f == "go.mod" {
			writeFile(t, filepath.Join(at, releaseVersion+".mod"), string(b))
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := seen["go.mod"]; !ok {
		t.Fatalf("module %s has no go.mod", mod)
	}
	info, err := json.Marshal(struct{ Version, Time string }{releaseVersion, time.Now().UTC().Format(time.RFC3339)})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(at, releaseVersion+".zip"), buf.String())
	writeFile(t, filepath.Join(at, releaseVersion+".info"), string(info))
	writeFile(t, filepath.Join(at, "list"), releaseVersion+"\n")
}

// escapePath is a module path as the module proxy protocol spells it in URLs and file names:
// each upper-case letter as "!" and its lower case.
func escapePath(p string) string {
	var b strings.Builder
	for _, r := range p {
		if unicode.IsUpper(r) {
			b.WriteByte('!')
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

// checkFilePath applies the module zip format's rules for file paths (module.CheckFilePath):
// clean, relative, and each element made of letters, digits and a few punctuation marks, and
// not a name Windows reserves.
func checkFilePath(f string) error {
	if f == "" || path.Clean(f) != f || strings.HasPrefix(f, "/") || !utf8.ValidString(f) {
		return fmt.Errorf("file path %q: not a clean relative path", f)
	}
	for _, e := range strings.Split(f, "/") {
		if e == "." || e == ".." {
			return fmt.Errorf("file path %q: element %q", f, e)
		}
		for _, r := range e {
			if !unicode.IsLetter(r) && !unicode.IsDigit(r) && !strings.ContainsRune("!#$%&()+,-.=@[]^_{}~ ", r) {
				return fmt.Errorf("file path %q: character %q is not allowed in a module", f, r)
			}
		}
		short, _, _ := strings.Cut(e, ".")
		switch strings.ToUpper(short) {
		case "CON", "PRN", "AUX", "NUL", "COM1", "COM2", "COM3", "COM4", "COM5", "COM6", "COM7", "COM8", "COM9",
			"LPT1", "LPT2", "LPT3", "LPT4", "LPT5", "LPT6", "LPT7", "LPT8", "LPT9":
			return fmt.Errorf("file path %q: %q is a name Windows reserves", f, e)
		}
	}
	return nil
}

func writeFile(t *testing.T, name, body string) {
	t.Helper()
	if err := os.WriteFile(name, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}
