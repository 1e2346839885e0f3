// Package pgtest gives each test its own migrated PostgreSQL database. It uses the server named by
// TEST_DATABASE_URL or DATABASE_URL when set; otherwise it starts one private throwaway cluster per
// test binary from the local server binaries (see package pgcluster). Call Main from TestMain so
// the cluster is removed when the tests end.
//
// The library (internal/pgtest) and the worker binary's module (cmd/worker/internal/pgtest) each
// have this file, the same but for the import path of package pgcluster (the binary's module may
// import no internal package of the library's); only migrate.go, which applies the schema,
// differs. cmd/worker's TestCopiesMatchLibrary checks that they stay the same.
package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/pgcluster"
)

var (
	once     sync.Once
	server   *serverInfo
	setupErr error
	counter  atomic.Int64
	createMu sync.Mutex
)

type serverInfo struct {
	admin    string // URL of a maintenance database on the server
	cluster  *pgcluster.Cluster
	template string
}

// Main runs the tests and then stops the private cluster, if one was started, or drops the
// template database it made on an external server.
func Main(m *testing.M) {
	code := m.Run()
	if server != nil && server.cluster != nil {
		server.cluster.Close()
	} else if server != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if err := exec(ctx, server.admin, "DROP DATABASE IF EXISTS "+server.template); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: drop the template database %s: %v\n", server.template, err)
		}
		cancel()
	}
	os.Exit(code)
}

func setup(t testing.TB) *serverInfo {
	t.Helper()
	once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		s := &serverInfo{}
		if u := firstNonEmpty(os.Getenv("TEST_DATABASE_URL"), os.Getenv("DATABASE_URL")); u != "" {
			s.admin = u
		} else {
			c, err := pgcluster.Start(ctx)
			if err != nil {
				setupErr = fmt.Errorf("start private PostgreSQL: %w", err)
				return
			}
			s.cluster = c
			s.admin = c.URL("postgres")
		}
		s.template = fmt.Sprintf("leash_tmpl_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
		if err := exec(ctx, s.admin, "CREATE DATABASE "+s.template); err != nil {
			setupErr = err
			return
		}
		conn, err := pgx.Connect(ctx, withDB(s.admin, s.template))
		if err != nil {
			setupErr = fmt.Errorf("connect to template: %w", err)
			return
		}
		err = migrate(ctx, conn)
		conn.Close(ctx)
		if err != nil {
			setupErr = err
			return
		}
		server = s
	})
	if setupErr != nil {
		t.Fatalf("pgtest: %v", setupErr)
	}
	return server
}

func firstNonEmpty(ss ...string) string {
	for _, s := range ss {
		if s != "" {
			return s
		}
	}
	return ""
}

func exec(ctx context.Context, connString, sql string) error {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		return fmt.Errorf("%s: %w", sql, err)
	}
	return nil
}

func withDB(connString, db string) string {
	u, err := url.Parse(connString)
	if err != nil || u.Scheme == "" {
		// keyword=value form
		return connString + " dbname=" + db
	}
	u.Path = "/" + db
	return u.String()
}

// EmptyURL creates a fresh database without leash's schema, for migration tests.
func EmptyURL(t testing.TB) string {
	t.Helper()
	return create(t, "template0")
}

// URL creates a fresh, migrated database for t and returns its connection string. The
// database is dropped when t ends (when the server is external; a private cluster goes away
// whole).
func URL(t testing.TB) string {
	t.Helper()
	return create(t, setup(t).template)
}

func create(t testing.TB, template string) string {
	t.Helper()
	s := setup(t)
	name := fmt.Sprintf("leash_t_%d_%d", os.Getpid(), counter.Add(1))
	ctx := context.Background()
	createMu.Lock()
	err := exec(ctx, s.admin, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, template))
	createMu.Unlock()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if s.cluster == nil {
		t.Cleanup(func() { _ = exec(ctx, s.admin, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)") })
	}
	return withDB(s.admin, name)
}

// Pool returns a connection pool on a fresh, migrated database, closed when t ends.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return PoolFor(t, URL(t))
}

// exampleTB lets examples, which have no *testing.T, take a database: a failure panics, and
// cleanups run when the example calls done.
type exampleTB struct {
	testing.TB
	cleanups []func()
}

func (e *exampleTB) Helper()                           {}
func (e *exampleTB) Cleanup(f func())                  { e.cleanups = append(e.cleanups, f) }
func (e *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

// ExamplePool is Pool for an Example function: a fresh migrated database, closed (and dropped)
// when the example calls done.
func ExamplePool() (db *pgxpool.Pool, done func()) {
	tb := &exampleTB{}
	db = Pool(tb)
	return db, func() {
		for i := len(tb.cleanups) - 1; i >= 0; i-- {
			tb.cleanups[i]()
		}
	}
}

// PoolFor returns a pool on connString with room for a worker and its test, closed when t ends.
func PoolFor(t testing.TB, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("pgtest: parse %q: %v", connString, err)
	}
	cfg.MaxConns = 12
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: pool: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

// Exec runs sql on connString (a fresh connection), failing t on an error: for setting up what
// a DBA would (ALTER DATABASE ... SET, CREATE ROLE).
func Exec(t testing.TB, connString, sql string) {
	t.Helper()
	if err := exec(context.Background(), connString, sql); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
}

// DatabaseName returns the database connString names.
func DatabaseName(t testing.TB, connString string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		t.Fatalf("pgtest: parse %q: %v", connString, err)
	}
	return cfg.Database
}

// Role creates a login role of its own for t (attrs as in CREATE ROLE, e.g. "SUPERUSER" or
// "CONNECTION LIMIT 3") with every right on schema leash of connString's database, and returns
// its name and connString as that role. The role is dropped when t ends, with what it owns.
func Role(t testing.TB, connString, attrs string) (name, roleURL string) {
	t.Helper()
	name = fmt.Sprintf("leash_r_%d_%d", os.Getpid(), counter.Add(1))
	Exec(t, connString, fmt.Sprintf(`CREATE ROLE %[1]s LOGIN %[2]s;
		DO $$ BEGIN
			IF to_regnamespace('leash') IS NOT NULL THEN
				GRANT USAGE, CREATE ON SCHEMA leash TO %[1]s;
				GRANT ALL ON ALL TABLES IN SCHEMA leash TO %[1]s;
				GRANT ALL ON ALL SEQUENCES IN SCHEMA leash TO %[1]s;
				GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA leash TO %[1]s;
			END IF;
		END $$`, name, attrs))
	t.Cleanup(func() {
		ctx := context.Background()
		_ = exec(ctx, connString, "DROP OWNED BY "+name)
		_ = exec(ctx, setup(t).admin, "DROP ROLE IF EXISTS "+name)
	})
	u, err := url.Parse(connString)
	if err != nil || u.Scheme == "" {
		return name, connString + " user=" + name
	}
	u.User = url.User(name)
	return name, u.String()
}
