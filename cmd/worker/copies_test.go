package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The worker's module may import no internal package of the library's, so it carries copies of
// the few the library's own tests share with it. Within a checkout of the repository they must
// stay the same as the library's, but for the import paths of each other.
func TestCopiesMatchLibrary(t *testing.T) {
	t.Parallel()
	lib := filepath.Join("..", "..")
	if _, err := os.Stat(filepath.Join(lib, "internal", "pgcluster")); err != nil {
		t.Skip("not in a checkout of the repository: the library's copies are not here to compare")
	}
	for _, f := range []string{"pgcluster/cluster.go", "pgtest/pgtest.go", "syncbuf/syncbuf.go"} {
		orig, err := os.ReadFile(filepath.Join(lib, "internal", f))
		if err != nil {
			t.Fatal(err)
		}
		cp, err := os.ReadFile(filepath.Join("internal", f))
		if err != nil {
			t.Fatal(err)
		}
		want := strings.ReplaceAll(string(orig), `"github.com/leashq/leash/internal/`, `"github.com/leashq/leash/cmd/worker/internal/`)
		if string(cp) != want {
			t.Errorf("cmd/worker/internal/%s differs from the library's internal/%s: make them the same", f, f)
		}
	}
}
