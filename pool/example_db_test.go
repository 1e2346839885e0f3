package pool_test

import (
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
)

// exampleDB is a fresh migrated database of the test suite, for examples; done closes it.
func exampleDB() (db *pgxpool.Pool, done func()) { return pgtest.ExamplePool() }
