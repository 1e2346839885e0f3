package store

import (
	"context"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	leashsql "github.com/leashq/leash/sql"
)

// migrateLockKey is the advisory lock taken by every migration run ("leash" in ASCII).
const migrateLockKey = 0x6c65617368

// Migration is one numbered schema file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations returns the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(leashsql.Files, ".")
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
		body, err := fs.ReadFile(leashsql.Files, name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: strings.TrimSuffix(name, ".sql"), SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Migrate applies every pending migration in one transaction under an advisory lock, and
// records each version in leash.schema_migrations. It returns the versions it applied; running
// it again, or from several processes at once, applies nothing twice.
func Migrate(ctx context.Context, db Beginner) ([]int, error) {
	all, err := Migrations()
	if err != nil {
		return nil, err
	}
	var applied []int
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(migrateLockKey)); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		if _, err := tx.Exec(ctx, `
			CREATE SCHEMA IF NOT EXISTS leash;
			CREATE TABLE IF NOT EXISTS leash.schema_migrations (
				version    integer PRIMARY KEY,
				name       text NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now()
			)`); err != nil {
			return fmt.Errorf("create migration table: %w", err)
		}
		done := map[int]bool{}
		rows, err := tx.Query(ctx, "SELECT version FROM leash.schema_migrations")
		if err != nil {
			return fmt.Errorf("read applied migrations: %w", err)
		}
		versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("read applied migrations: %w", err)
		}
		for _, v := range versions {
			done[int(v)] = true
		}
		for _, m := range all {
			if done[m.Version] {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("apply migration %s: %w", m.Name, err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO leash.schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
				return fmt.Errorf("record migration %s: %w", m.Name, err)
			}
			applied = append(applied, m.Version)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	return applied, nil
}
