// Package version names the release this tree is. CHANGELOG.md lists every release with the
// commit it is cut from; the upgrade test checks that its newest entry is this one.
package version

// Release is leash's release version (semantic versioning, without the leading "v" of its tag).
const Release = "0.2.0"
