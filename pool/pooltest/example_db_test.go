package pooltest_test

import (
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
)

// exampleDB is a fresh database with leash's schema, as pooltest.Database gives a test, for
// examples (which have no *testing.T); done closes it.
func exampleDB() (db *pgxpool.Pool, done func()) { return pgtest.ExamplePool() }
