package pool

// Release is the release of leash this package belongs to (semantic versioning, without the
// leading "v" of its tag), for a program to report next to SchemaVersion. CHANGELOG.md lists
// every release with the commit it is cut from; the upgrade test checks that its newest entry is
// this one.
const Release = "0.3.0"
