package store

import "context"

// Hooks for migrate_test.go, which applies migration sets of its own.
func ApplyMigrations(ctx context.Context, db Beginner, all []Migration) ([]Migration, error) {
	return applyMigrations(ctx, db, all, ApplyOptions{})
}

func ApplyMigrationsWith(ctx context.Context, db Beginner, all []Migration, o ApplyOptions) ([]Migration, error) {
	return applyMigrations(ctx, db, all, o)
}

var (
	MigrationsFrom  = migrationsFrom
	SplitStatements = splitStatements
)

// ClaimQuery is the statement and arguments Claim sends, for tests that EXPLAIN it.
var ClaimQuery = claimQuery
