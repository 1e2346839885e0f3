// Package modgraph holds no code, only tests of the repository's module layout: what an
// application that imports the library gets in its module graph, that the worker binary builds
// on the library's public packages alone, and that a release of the published modules installs
// with the go command from a module proxy (TestReleaseInstalls).
package modgraph
