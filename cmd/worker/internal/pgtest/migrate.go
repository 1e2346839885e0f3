package pgtest

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/pool"
)

// migrate applies leash's schema to the template database, through the library's public API.
func migrate(ctx context.Context, conn *pgx.Conn) error {
	_, err := pool.Migrate(ctx, conn)
	return err
}
