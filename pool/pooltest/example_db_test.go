package pooltest_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool/pooltest"
)

// exampleTB lets examples, which have no *testing.T, take a database from pooltest.Database: a failure
// panics, and cleanups run when the example calls done.
type exampleTB struct {
	testing.TB
	cleanups []func()
}

func (e *exampleTB) Helper()                           {}
func (e *exampleTB) Cleanup(f func())                  { e.cleanups = append(e.cleanups, f) }
func (e *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

// exampleDB is a fresh migrated database of the test suite, for examples; done closes it.
func exampleDB() (db *pgxpool.Pool, done func()) {
	tb := &exampleTB{}
	db = pooltest.Database(tb)
	return db, func() {
		for i := len(tb.cleanups) - 1; i >= 0; i-- {
			tb.cleanups[i]()
		}
	}
}
