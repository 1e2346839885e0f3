// Package sql holds leash's schema migrations as numbered plain-SQL files, readable from a
// console and embedded into every binary that imports leash. Apply them with pool.Migrate or
// `worker migrate`.
package sql

import "embed"

// Files holds the migrations, named NNN_description.sql and applied in numeric order.
//
//go:embed *.sql
var Files embed.FS
