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

// ClaimQuery is the statement and arguments Claim sends, for tests that EXPLAIN it, and
// ClaimPlanSQL the plan settings Claim sends before it.
var (
	ClaimQuery   = claimQuery
	ClaimPlanSQL = claimPlanSQL
)

// TextArray and Int8Array are the arrays an outcome batch sends, for tests that send them in
// every exec mode.
func TextArray(s []string) any { return textArray(s) }

func Int8Array(s []int64) any { return int8Array(s) }
