package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/leashq/leash/pool"
)

func TestVersionOf(t *testing.T) {
	t.Parallel()
	checkout := "v" + pool.Release
	for name, c := range map[string]struct {
		info *debug.BuildInfo
		want buildVersion
	}{
		"no build info": {nil, buildVersion{Release: checkout, Revision: "unknown"}},
		"go run in a checkout": {&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}},
			buildVersion{Release: checkout, Revision: "unknown"}},
		"go build with VCS stamping": {&debug.BuildInfo{
			Main: debug.Module{Version: "v0.3.1-0.20270101000000-0123456789ab+dirty"},
			Settings: []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "0123456789abcdef"},
				{Key: "vcs.modified", Value: "true"}},
		}, buildVersion{Release: checkout, Revision: "0123456789abcdef", Modified: true}},
		"go install at a release": {&debug.BuildInfo{Main: debug.Module{Version: "v0.3.0", Sum: "h1:abc="}},
			buildVersion{Release: "v0.3.0", Revision: "unknown", Sum: "h1:abc="}},
		"go install at a commit": {&debug.BuildInfo{Main: debug.Module{Version: "v0.3.1-0.20270101000000-0123456789ab"}},
			buildVersion{Release: "v0.3.1-0.20270101000000-0123456789ab", Revision: "unknown"}},
	} {
		if got := versionOf(c.info); got != c.want {
			t.Errorf("%s: got %+v, want %+v", name, got, c.want)
		}
	}
}

// The release constant the binary reports from a checkout is CHANGELOG.md's newest release.
func TestReleaseIsChangelogs(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## \[(\d+\.\d+\.\d+)\]`).FindSubmatch(b)
	if m == nil {
		t.Fatal("CHANGELOG.md names no release (a heading ## [X.Y.Z] - YYYY-MM-DD)")
	}
	if string(m[1]) != pool.Release {
		t.Fatalf("CHANGELOG.md's newest release is %s; the binary reports release %s (pool.Release)", m[1], pool.Release)
	}
}

// A build that sets main.revision (as the Dockerfile does) reports it: builds in this checkout
// (workspace mode) get no VCS stamp from the go command.
func TestVersionRevisionFromLinker(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "worker")
	build := exec.Command("go", "build", "-ldflags=-X main.revision=feedface0123", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("worker version: %v\n%s", err, out)
	}
	if want := "worker v" + pool.Release + "\nrevision feedface0123\n"; !strings.HasPrefix(string(out), want) {
		t.Fatalf("worker version printed\n%s\nwant it to start with\n%s", out, want)
	}
}
