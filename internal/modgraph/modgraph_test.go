package modgraph_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// forbidden are the module path prefixes of what the binary, the otel module and the benchmarks
// need, which an application that imports the library must not get.
var forbidden = []string{
	"github.com/chromedp/",
	"github.com/prometheus/",
	"go.opentelemetry.io/",
	"github.com/lmittmann/tint",
	"github.com/sethvargo/go-envconfig",
	"github.com/riverqueue/",
}

func root(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		t.Fatalf("no go.mod at the repository root %s: %v", dir, err)
	}
	return dir
}

// goCmd runs the go command in dir with env added and returns its standard output.
func goCmd(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command on PATH")
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, stderr.String())
	}
	return string(out)
}

// An application that requires the library and imports its public packages gets, in its module
// graph, only what the library needs: none of the binary's, the otel module's or the benchmarks'
// dependencies.
func TestApplicationModuleGraph(t *testing.T) {
	t.Parallel()
	lib := root(t)
	app := t.TempDir()
	gomod := fmt.Sprintf(`module example.com/app

go 1.26.8

require github.com/leashq/leash v0.3.0

replace github.com/leashq/leash => %s
`, lib)
	main := `package main

import (
	_ "github.com/leashq/leash/handlers"
	_ "github.com/leashq/leash/lease"
	_ "github.com/leashq/leash/notify"
	_ "github.com/leashq/leash/pool"
)

func main() {}
`
	sum, err := os.ReadFile(filepath.Join(lib, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{"go.mod": gomod, "main.go": main, "go.sum": string(sum)} {
		if err := os.WriteFile(filepath.Join(app, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Outside the tree no go.work applies; the library's go.sum covers its dependencies, so
	// tidying needs the module cache (or proxy) only for what the library itself requires.
	env := []string{"GOWORK=off", "GOFLAGS=-mod=mod"}
	goCmd(t, app, env, "mod", "tidy")
	mods := goCmd(t, app, env, "list", "-m", "all")
	pkgs := goCmd(t, app, env, "list", "-deps", ".")
	for _, line := range strings.Split(mods+pkgs, "\n") {
		for _, f := range forbidden {
			if strings.HasPrefix(line, f) {
				t.Errorf("an application importing the library gets %s", line)
			}
		}
	}
	if t.Failed() {
		t.Logf("go list -m all:\n%s", mods)
	}
}

// The worker binary's module (its code and its tests) imports none of the library's internal
// packages: it is built on the public API, so that a release of the binary does not depend on the
// library's unexported details. The otel module's code does the same.
func TestModulesUsePublicPackages(t *testing.T) {
	t.Parallel()
	lib := root(t)
	for _, m := range []struct {
		dir   string
		tests bool
	}{{"cmd/worker", true}, {"otel", false}} {
		format := `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`
		if m.tests {
			format += `{{range .TestImports}} {{.}}{{end}}{{range .XTestImports}} {{.}}{{end}}`
		}
		out := goCmd(t, filepath.Join(lib, m.dir), nil, "list", "-f", format, "./...")
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			fields := strings.Fields(line)
			for _, imp := range fields[1:] {
				if strings.HasPrefix(imp, "github.com/leashq/leash/internal/") {
					t.Errorf("%s imports %s, an internal package of the library", fields[0], imp)
				}
			}
		}
	}
}
