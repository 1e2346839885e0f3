package pgtest

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/store"
)

// migrate applies leash's schema to the template database. The library's tests reach the store
// directly: package pool's own tests use pgtest, so pgtest cannot import pool.
func migrate(ctx context.Context, conn *pgx.Conn) error {
	_, err := store.Migrate(ctx, conn)
	return err
}
