// Package modgraph holds no code, only tests of the repository's module layout: what an
// application that imports the library gets in its module graph, and that the worker binary
// builds on the library's public packages alone.
package modgraph
