package pool

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leashq/leash/internal/store"
)

// Migration is one of leash's numbered schema migrations (sql/NNN_name.sql).
type Migration struct {
	Version int
	Name    string // the file name without .sql, e.g. "004_queues"
	SQL     string // the file's text, for review; Migrate and MigrateWith apply it
	// NoTransaction: the migration must run outside a transaction, one statement at a time
	// (CREATE INDEX CONCURRENTLY); each of its statements is safe to repeat.
	NoTransaction bool
}

// AppliedMigration is a migration recorded in leash.schema_migrations.
type AppliedMigration struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

// SchemaVersion is the schema version this package needs: its highest migration.
func SchemaVersion() int { return store.ExpectedVersion() }

// Migrations lists the migrations this package carries, in version order.
func Migrations() []Migration {
	all, err := store.Migrations()
	if err != nil {
		panic(err) // the embedded files are checked by the tests
	}
	return migrations(all)
}

func migrations(ms []store.Migration) []Migration {
	out := make([]Migration, len(ms))
	for i, m := range ms {
		out[i] = Migration(m)
	}
	return out
}

// SchemaStatus compares a database's schema with the migrations this package carries.
type SchemaStatus struct {
	// Tracked: leash.schema_migrations exists (false: no leash schema at all).
	Tracked bool
	// Current is the highest version applied; 0 when none.
	Current int
	// Expected is SchemaVersion.
	Expected int
	// Applied lists every migration recorded, in version order.
	Applied []AppliedMigration
	// Pending lists the migrations this package carries that the database lacks.
	Pending []Migration
	// Unknown lists applied migrations this package does not carry: a newer release's.
	Unknown []AppliedMigration
}

// Behind reports that the database lacks migrations this package needs (or has no leash schema
// at all): run Migrate before starting a Pool on it.
func (s SchemaStatus) Behind() bool { return !s.Tracked || len(s.Pending) > 0 }

// Ahead reports that the database was migrated by a newer release. Migrations are additive, so
// this release keeps working on it.
func (s SchemaStatus) Ahead() bool { return len(s.Unknown) > 0 }

// ReadSchemaStatus reads leash.schema_migrations and compares it with Migrations. It changes
// nothing and needs no lock.
func ReadSchemaStatus(ctx context.Context, db DB) (SchemaStatus, error) {
	c, err := store.CheckSchema(ctx, db)
	if err != nil {
		return SchemaStatus{}, err
	}
	return SchemaStatus{Tracked: c.Tracked, Current: c.Current, Expected: c.Expected, Applied: applied(c.Applied),
		Pending: migrations(c.Missing), Unknown: applied(c.Unknown)}, nil
}

func applied(as []store.AppliedMigration) []AppliedMigration {
	if as == nil {
		return nil
	}
	out := make([]AppliedMigration, len(as))
	for i, a := range as {
		out[i] = AppliedMigration(a)
	}
	return out
}

// ErrMigrationLockTimeout: a migration gave up waiting for a table lock (MigrateOptions.LockTimeout)
// and nothing of its transaction was applied. Try again later.
var ErrMigrationLockTimeout = errors.New("migration gave up waiting for a lock")

// MigrateOptions tune MigrateWith for a database in use.
type MigrateOptions struct {
	// LockTimeout bounds every wait for a table lock. A migration's ALTER TABLE waits for the
	// transactions using the table, and every query on the table queues behind it meanwhile; with
	// a LockTimeout the migration gives up instead (an error wrapping ErrMigrationLockTimeout).
	// 0: wait as long as it takes, whatever lock_timeout the database or role sets.
	LockTimeout time.Duration
}

// MigrateWith is Migrate with options; it returns the migrations it applied, in order, also when
// it fails part-way (those before the failure are committed). A migration that builds an index
// CONCURRENTLY runs on a session of its own: db must then be a *pgxpool.Pool or a *pgx.Conn.
func MigrateWith(ctx context.Context, db Beginner, o MigrateOptions) ([]Migration, error) {
	if o.LockTimeout < 0 {
		return nil, errors.New("pool: MigrateOptions.LockTimeout must not be negative")
	}
	done, err := store.ApplyWith(ctx, db, store.ApplyOptions{LockTimeout: o.LockTimeout})
	if store.IsLockTimeout(err) {
		err = fmt.Errorf("%w: %w", ErrMigrationLockTimeout, err)
	}
	return migrations(done), err
}
