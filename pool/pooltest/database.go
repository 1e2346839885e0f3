package pooltest

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgtest"
)

// Database returns a pool on a fresh database with leash's schema, for one test, closed (and
// the database dropped, on an external server) when tb ends. Each call gets a database of its
// own, so tests that use it may run in parallel.
//
// The databases live on the server TEST_DATABASE_URL names (or DATABASE_URL), whose role must
// be allowed to create databases; with neither set, Database starts one private throwaway
// PostgreSQL cluster for the test binary from the local server binaries (initdb and postgres on
// PATH or under /usr/lib/postgresql/*/bin; as root it runs them as the postgres user). Call Main
// from TestMain so that the cluster is removed when the tests end:
//
//	func TestMain(m *testing.M) { pooltest.Main(m) }
func Database(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	return pgtest.Pool(tb)
}

// Main runs the tests of m and exits with their status, after stopping the private cluster
// Database started, if any (or dropping the template database it made on an external server).
// Call it from TestMain.
func Main(m *testing.M) { pgtest.Main(m) }
