// Package upgrade is leash's rolling-upgrade test (its tests only): for every release listed in
// CHANGELOG.md that is older than the tree under test, it builds that release's worker from git
// history, runs it, migrates its database with this tree's worker while it works, replaces it
// with this tree's worker, and checks that every job completed exactly once and that neither
// worker logged an error.
package upgrade
