package main

import (
	"fmt"
	"io"
	"runtime/debug"

	"github.com/leashq/leash/pool"
)

// revision is the VCS revision of a build that sets it with
// -ldflags "-X main.revision=$(git rev-parse HEAD)": the go command records none in workspace
// mode (a build in this checkout) or with -buildvcs=false. The Dockerfile sets it.
var revision string

// buildVersion is what `worker version` reports about the binary.
type buildVersion struct {
	// Release is the version this binary is of: the module version the go command recorded
	// when it built the binary from a module download (`go install ...@v0.3.0`), else, for a
	// build from a checkout, "v" and the library's release constant.
	Release string
	// Revision is the VCS revision the binary was built from (the build's vcs.revision, else
	// main.revision set by the linker), "unknown" when neither says (a build from a module
	// download, whose Release and Sum identify it, or a checkout build without the flag).
	Revision string
	// Modified says the checkout had uncommitted changes at the build.
	Modified bool
	// Sum is the module's checksum when the binary was built from a module download.
	Sum string
}

// versionOf reads info, the binary's build information (nil when it has none).
func versionOf(info *debug.BuildInfo) buildVersion {
	v := buildVersion{Release: "v" + pool.Release, Revision: "unknown"}
	if revision != "" {
		v.Revision = revision
	}
	if info == nil {
		return v
	}
	fromVCS := false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision, fromVCS = s.Value, true
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	// A build in a checkout records "(devel)", or with VCS stamping a version derived from the
	// checkout's tags and commit; the release constant says better which release that is.
	if m := info.Main.Version; m != "" && m != "(devel)" && !fromVCS {
		v.Release, v.Sum = m, info.Main.Sum
	}
	return v
}

// cmdVersion prints the release, the VCS revision and the schema version this worker needs.
func cmdVersion(stdout io.Writer) {
	info, _ := debug.ReadBuildInfo()
	v := versionOf(info)
	rev := v.Revision
	if v.Modified {
		rev += " (modified)"
	}
	fmt.Fprintf(stdout, "worker %s\nrevision %s\n", v.Release, rev)
	if v.Sum != "" {
		fmt.Fprintf(stdout, "module sum %s\n", v.Sum)
	}
	fmt.Fprintf(stdout, "schema version %d\n", pool.SchemaVersion())
}
