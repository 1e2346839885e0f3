package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	leashsql "github.com/leashq/leash/sql"
)

// migrateLockKey is the advisory lock taken by every migration run ("leash" in ASCII).
const migrateLockKey = 0x6c65617368

// NoTransactionMarker, alone on a line of a migration's leading comment block, makes the
// migration run outside a transaction, one statement at a time: what CREATE INDEX CONCURRENTLY,
// DROP INDEX CONCURRENTLY and ALTER TYPE ... ADD VALUE (before PostgreSQL 12) need. Such a
// migration is recorded only once all its statements succeeded; one that fails part-way is
// run again from its first statement, so each statement must be safe to repeat (IF NOT EXISTS,
// and a DROP INDEX CONCURRENTLY IF EXISTS before a CREATE INDEX CONCURRENTLY that an
// interrupted build may have left invalid).
const NoTransactionMarker = "-- leash:no-transaction"

// Migration is one numbered schema file.
type Migration struct {
	Version int
	Name    string
	SQL     string
	// NoTransaction is set by NoTransactionMarker.
	NoTransaction bool
}

// AppliedMigration is one row of leash.schema_migrations.
type AppliedMigration struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

// Migrations returns the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	return migrationsFrom(leashsql.Files)
}

func migrationsFrom(fsys fs.FS) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		if path.Ext(name) != ".sql" {
			continue
		}
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration %q: name must start with a positive number and '_'", name)
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrations %q and %q share version %d", prev, name, v)
		}
		seen[v] = name
		body, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		m := Migration{Version: v, Name: strings.TrimSuffix(name, ".sql"), SQL: string(body), NoTransaction: hasNoTxMarker(string(body))}
		if m.NoTransaction && len(splitStatements(m.SQL)) == 0 {
			return nil, fmt.Errorf("migration %q: no statement", name)
		}
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// hasNoTxMarker looks for NoTransactionMarker in the comment lines that open the file.
func hasNoTxMarker(sql string) bool {
	for line := range strings.Lines(sql) {
		line = strings.TrimSpace(line)
		switch {
		case line == NoTransactionMarker:
			return true
		case line == "" || strings.HasPrefix(line, "--"):
			continue
		}
		return false
	}
	return false
}

// ExpectedVersion is the schema version this binary needs: its highest embedded migration.
func ExpectedVersion() int {
	all, err := Migrations()
	if err != nil || len(all) == 0 {
		return 0
	}
	return all[len(all)-1].Version
}

// Migrate applies every pending migration under an advisory lock and records each version in
// leash.schema_migrations. It returns the versions it applied; running it again, or from several
// processes at once, applies nothing twice. See Apply.
func Migrate(ctx context.Context, db Beginner) ([]int, error) {
	applied, err := Apply(ctx, db)
	versions := make([]int, len(applied))
	for i, m := range applied {
		versions[i] = m.Version
	}
	return versions, err
}

// Apply applies every pending migration and returns the ones it applied, in order. Consecutive
// pending migrations run in one transaction under an advisory lock, so that a release's schema
// change lands whole or not at all and two migrators never race. A migration marked
// NoTransactionMarker runs on a session of its own (db must then be a *pgxpool.Pool or a
// *pgx.Conn), under the same lock held for the session, statement by statement; the migrations
// before it are committed first. On an error, the migrations committed before it are returned
// with it.
func Apply(ctx context.Context, db Beginner) ([]Migration, error) {
	return ApplyWith(ctx, db, ApplyOptions{})
}

// ApplyOptions tune Apply for a database in use.
type ApplyOptions struct {
	// LockTimeout bounds every wait for a lock on a table (PostgreSQL's lock_timeout). A
	// migration's ALTER TABLE waits for transactions using the table to end, and every query on
	// the table queues behind it meanwhile: a long transaction would stall the whole fleet for as
	// long. With a LockTimeout the migration gives up instead (IsLockTimeout), having applied
	// nothing of the transaction that gave up; try again later. 0 waits as long as it takes,
	// whatever lock_timeout the database or role sets.
	LockTimeout time.Duration
}

// IsLockTimeout reports whether a migration gave up waiting for a lock (ApplyOptions.LockTimeout).
func IsLockTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03" // lock_not_available
}

// ApplyWith is Apply with options.
func ApplyWith(ctx context.Context, db Beginner, o ApplyOptions) ([]Migration, error) {
	all, err := Migrations()
	if err != nil {
		return nil, err
	}
	return applyMigrations(ctx, db, all, o)
}

func applyMigrations(ctx context.Context, db Beginner, all []Migration, o ApplyOptions) ([]Migration, error) {
	var applied []Migration
	for {
		done, next, err := applyInTx(ctx, db, all, o)
		applied = append(applied, done...)
		if err != nil {
			return applied, fmt.Errorf("migrate: %w", err)
		}
		if next == nil {
			return applied, nil
		}
		ran, err := applyOutsideTx(ctx, db, *next, o)
		if err != nil {
			return applied, fmt.Errorf("migrate: %w", err)
		}
		if ran {
			applied = append(applied, *next)
		}
	}
}

// lockTimeout is the setting's value for o: whole milliseconds, at least one; "0" (none) when
// o has no LockTimeout.
func (o ApplyOptions) lockTimeout() string {
	if o.LockTimeout <= 0 {
		return "0"
	}
	return strconv.FormatInt(max(o.LockTimeout.Milliseconds(), 1), 10) + "ms"
}

// migrationSettings are the settings a migration runs with, whatever the database's or role's
// defaults: object names resolve in pg_catalog first (a column default's now() binds to
// pg_catalog.now, not to a now() someone put in public), no statement timeout (an index built
// concurrently on a large table takes as long as it takes; the wait for a lock is bounded by
// ApplyOptions.LockTimeout alone, and retried), no idle-in-transaction timeout.
func (o ApplyOptions) migrationSettings() [][2]string {
	return [][2]string{
		{"search_path", "pg_catalog, pg_temp"},
		{"statement_timeout", "0"},
		{"lock_timeout", o.lockTimeout()},
		{"idle_in_transaction_session_timeout", "0"},
		{"default_transaction_isolation", "read committed"},
	}
}

// pinMigrationTx is the first statement of a migration transaction: read committed (each
// statement sees what the ones before it committed, as a console's migration would), and
// migrationSettings for the transaction only.
func (o ApplyOptions) pinMigrationTx() string {
	var b strings.Builder
	b.WriteString("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SELECT ")
	for i, kv := range o.migrationSettings() {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "pg_catalog.set_config('%s', '%s', true)", kv[0], kv[1])
	}
	return b.String()
}

const createMigrationTable = `
	CREATE SCHEMA IF NOT EXISTS leash;
	CREATE TABLE IF NOT EXISTS leash.schema_migrations (
		version    integer PRIMARY KEY,
		name       text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now()
	)`

// errLockBusy: another migrator holds the migration lock.
var errLockBusy = errors.New("migration lock busy")

// waitForLock retries try while the migration lock is busy. Migrators wait for the lock by
// polling rather than blocking in pg_advisory_lock: a backend blocked there holds a snapshot, and
// CREATE INDEX CONCURRENTLY in the migrator holding the lock waits for every older snapshot to
// go away, which would deadlock.
func waitForLock(ctx context.Context, try func() error) error {
	wait := 10 * time.Millisecond
	for {
		err := try()
		if !errors.Is(err, errLockBusy) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the migration lock: %w", context.Cause(ctx))
		case <-time.After(wait):
		}
		wait = min(2*wait, 250*time.Millisecond)
	}
}

// applyInTx applies, in one transaction, the pending migrations up to the first pending one
// that must run outside a transaction, which it returns (nil when there is none).
func applyInTx(ctx context.Context, db Beginner, all []Migration, o ApplyOptions) (done []Migration, next *Migration, err error) {
	err = waitForLock(ctx, func() error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			done, next = nil, nil
			if _, err := tx.Exec(ctx, o.pinMigrationTx()); err != nil {
				return fmt.Errorf("pin the migration's settings: %w", err)
			}
			var locked bool
			if err := tx.QueryRow(ctx, "SELECT pg_catalog.pg_try_advisory_xact_lock($1)", int64(migrateLockKey)).Scan(&locked); err != nil {
				return fmt.Errorf("take migration lock: %w", err)
			}
			if !locked {
				return errLockBusy
			}
			if _, err := tx.Exec(ctx, createMigrationTable); err != nil {
				return fmt.Errorf("create migration table: %w", err)
			}
			have, err := appliedVersions(ctx, tx)
			if err != nil {
				return err
			}
			for _, m := range all {
				if have[m.Version] {
					continue
				}
				if m.NoTransaction {
					next = &m
					return nil
				}
				if _, err := tx.Exec(ctx, m.SQL); err != nil {
					return fmt.Errorf("apply migration %s: %w", m.Name, err)
				}
				if err := record(ctx, tx, m); err != nil {
					return err
				}
				done = append(done, m)
			}
			return nil
		})
	})
	if err != nil {
		return nil, nil, err
	}
	return done, next, nil
}

func appliedVersions(ctx context.Context, db DBTX) (map[int]bool, error) {
	rows, err := db.Query(ctx, "SELECT version FROM leash.schema_migrations")
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	have := map[int]bool{}
	for _, v := range versions {
		have[int(v)] = true
	}
	return have, nil
}

func record(ctx context.Context, db DBTX, m Migration) error {
	if _, err := db.Exec(ctx, "INSERT INTO leash.schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
		return fmt.Errorf("record migration %s: %w", m.Name, err)
	}
	return nil
}

// applyOutsideTx runs a no-transaction migration on one session holding the migration lock. It
// reports false when another migrator applied it first.
func applyOutsideTx(ctx context.Context, db Beginner, m Migration, o ApplyOptions) (ran bool, err error) {
	var conn *pgx.Conn
	switch d := db.(type) {
	case *pgx.Conn:
		conn = d
	case *pgxpool.Pool:
		pc, err := d.Acquire(ctx)
		if err != nil {
			return false, fmt.Errorf("apply migration %s: %w", m.Name, err)
		}
		defer pc.Release()
		conn = pc.Conn()
	default:
		return false, fmt.Errorf("apply migration %s: it runs outside a transaction and needs a *pgxpool.Pool or a *pgx.Conn, not %T", m.Name, db)
	}
	err = waitForLock(ctx, func() error {
		var locked bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(migrateLockKey)).Scan(&locked); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		if !locked {
			return errLockBusy
		}
		return nil
	})
	if err != nil {
		return false, err
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, "SELECT pg_advisory_unlock($1)", int64(migrateLockKey)); uerr != nil {
			// The session would keep the lock: close it rather than return it to a pool.
			conn.Close(uctx)
		}
	}()
	have, err := appliedVersions(ctx, conn)
	if err != nil {
		return false, err
	}
	if have[m.Version] {
		return false, nil
	}
	// The session is the caller's: its settings are set for the migration and put back after.
	restore, err := pinMigrationSession(ctx, conn, o)
	if err != nil {
		return false, err
	}
	defer restore()
	for i, stmt := range splitStatements(m.SQL) {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			return false, fmt.Errorf("apply migration %s (outside a transaction), statement %d: %w", m.Name, i+1, err)
		}
	}
	return true, record(ctx, conn, m)
}

// pinMigrationSession sets migrationSettings on conn for a migration run outside a transaction
// (each statement then runs in a transaction of its own, read committed); the returned function
// puts the session's previous values back.
func pinMigrationSession(ctx context.Context, conn *pgx.Conn, o ApplyOptions) (func(), error) {
	settings := o.migrationSettings()
	names, values := make([]string, len(settings)), make([]string, len(settings))
	for i, kv := range settings {
		names[i], values[i] = kv[0], kv[1]
	}
	const set = `SELECT pg_catalog.set_config(n, v, false) FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) AS s (n, v)`
	var prev []string
	err := conn.QueryRow(ctx, `SELECT pg_catalog.array_agg(pg_catalog.current_setting(n) ORDER BY i)
		FROM pg_catalog.unnest($1::pg_catalog.text[]) WITH ORDINALITY AS s (n, i)`, names).Scan(&prev)
	if err == nil {
		_, err = conn.Exec(ctx, set, names, values)
	}
	if err != nil {
		return nil, fmt.Errorf("pin the migration's settings: %w", err)
	}
	return func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		conn.Exec(rctx, set, names, prev)
	}, nil
}

// splitStatements cuts a script into its statements at semicolons outside quotes, dollar
// quotes and comments, dropping those that hold nothing but comments and space.
func splitStatements(sql string) []string {
	var out []string
	start := 0
	flush := func(end int) {
		s := strings.TrimSpace(sql[start:end])
		if strings.TrimSpace(stripComments(s)) != "" {
			out = append(out, s)
		}
	}
	for i := 0; i < len(sql); {
		switch c := sql[i]; {
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			if n := strings.IndexByte(sql[i:], '\n'); n >= 0 {
				i += n + 1
			} else {
				i = len(sql)
			}
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			i = skipBlockComment(sql, i)
		case c == '\'':
			escapes := i > 0 && (sql[i-1] == 'E' || sql[i-1] == 'e') && (i == 1 || !isIdentChar(sql[i-2]))
			i = skipQuoted(sql, i, '\'', escapes)
		case c == '"':
			i = skipQuoted(sql, i, '"', false)
		case c == '$' && (i == 0 || !isIdentChar(sql[i-1])):
			if tag, ok := dollarTag(sql[i:]); ok {
				if n := strings.Index(sql[i+len(tag):], tag); n >= 0 {
					i += len(tag) + n + len(tag)
				} else {
					i = len(sql)
				}
			} else {
				i++
			}
		case c == ';':
			flush(i)
			i++
			start = i
		default:
			i++
		}
	}
	flush(len(sql))
	return out
}

func isIdentChar(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= 0x80
}

// dollarTag returns the $tag$ that s starts with.
func dollarTag(s string) (string, bool) {
	for j := 1; j < len(s); j++ {
		if s[j] == '$' {
			return s[:j+1], true
		}
		if !isIdentChar(s[j]) || (j == 1 && s[j] >= '0' && s[j] <= '9') {
			return "", false
		}
	}
	return "", false
}

// skipQuoted returns the index after the quoted text starting at i; a doubled quote stays
// inside, as does a backslash-escaped character when escapes is set (E'...').
func skipQuoted(s string, i int, q byte, escapes bool) int {
	for j := i + 1; j < len(s); j++ {
		switch {
		case escapes && s[j] == '\\':
			j++
		case s[j] == q && j+1 < len(s) && s[j+1] == q:
			j++
		case s[j] == q:
			return j + 1
		}
	}
	return len(s)
}

// skipBlockComment returns the index after the (possibly nested) comment starting at i.
func skipBlockComment(s string, i int) int {
	depth := 0
	for j := i; j < len(s); {
		switch {
		case strings.HasPrefix(s[j:], "/*"):
			depth++
			j += 2
		case strings.HasPrefix(s[j:], "*/"):
			depth--
			j += 2
			if depth == 0 {
				return j
			}
		default:
			j++
		}
	}
	return len(s)
}

// stripComments removes comments outside quotes, to tell an empty statement.
func stripComments(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		switch {
		case strings.HasPrefix(s[i:], "--"):
			if n := strings.IndexByte(s[i:], '\n'); n >= 0 {
				i += n + 1
			} else {
				i = len(s)
			}
		case strings.HasPrefix(s[i:], "/*"):
			i = skipBlockComment(s, i)
		case s[i] == '\'' || s[i] == '"':
			j := skipQuoted(s, i, s[i], false)
			b.WriteString(s[i:j])
			i = j
		default:
			b.WriteByte(s[i])
			i++
		}
	}
	return b.String()
}

// SchemaStatus reads leash.schema_migrations: the migrations applied, in version order and with
// applied_at (including versions this binary does not embed, applied by a newer release), and
// the embedded migrations not applied yet. A database without leash.schema_migrations has
// nothing applied and every migration pending.
func SchemaStatus(ctx context.Context, db DBTX) (applied []AppliedMigration, pending []Migration, err error) {
	c, err := CheckSchema(ctx, db)
	if err != nil {
		return nil, nil, err
	}
	return c.Applied, c.Missing, nil
}

// SchemaCheck compares a database's schema with the migrations this binary embeds.
type SchemaCheck struct {
	// Tracked: leash.schema_migrations exists.
	Tracked bool
	// Current is the highest version applied; 0 when none.
	Current int
	// Expected is the highest version this binary embeds (ExpectedVersion).
	Expected int
	// Applied lists the rows of leash.schema_migrations in version order.
	Applied []AppliedMigration
	// Missing lists the embedded migrations the database lacks: this binary needs them.
	Missing []Migration
	// Unknown lists applied migrations this binary does not embed: a newer release's.
	Unknown []AppliedMigration
}

// Behind reports that the database lacks migrations this binary needs (or has no leash schema
// at all): a worker must not run on it before they are applied.
func (c SchemaCheck) Behind() bool { return !c.Tracked || len(c.Missing) > 0 }

// Ahead reports that the database has migrations this binary does not know: it was migrated by
// a newer release. Migrations are additive, so an older worker keeps working.
func (c SchemaCheck) Ahead() bool { return len(c.Unknown) > 0 }

// CheckSchema reads leash.schema_migrations and compares it with the embedded migrations.
func CheckSchema(ctx context.Context, db DBTX) (SchemaCheck, error) {
	all, err := Migrations()
	if err != nil {
		return SchemaCheck{}, err
	}
	c := SchemaCheck{}
	if len(all) > 0 {
		c.Expected = all[len(all)-1].Version
	}
	if err := db.QueryRow(ctx, "SELECT to_regclass('leash.schema_migrations') IS NOT NULL").Scan(&c.Tracked); err != nil {
		return SchemaCheck{}, fmt.Errorf("read schema version: %w", err)
	}
	if !c.Tracked {
		c.Missing = all
		return c, nil
	}
	rows, err := db.Query(ctx, "SELECT version, name, applied_at FROM leash.schema_migrations ORDER BY version")
	if err != nil {
		return SchemaCheck{}, fmt.Errorf("read schema version: %w", err)
	}
	c.Applied, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (AppliedMigration, error) {
		var a AppliedMigration
		var v int32
		err := r.Scan(&v, &a.Name, &a.AppliedAt)
		a.Version = int(v)
		return a, err
	})
	if err != nil {
		return SchemaCheck{}, fmt.Errorf("read schema version: %w", err)
	}
	have := map[int]bool{}
	for _, a := range c.Applied {
		have[a.Version] = true
		c.Current = max(c.Current, a.Version)
		if !slices.ContainsFunc(all, func(m Migration) bool { return m.Version == a.Version }) {
			c.Unknown = append(c.Unknown, a)
		}
	}
	for _, m := range all {
		if !have[m.Version] {
			c.Missing = append(c.Missing, m)
		}
	}
	return c, nil
}
