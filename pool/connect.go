package pool

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/netdial"
	"github.com/leashq/leash/internal/store"
)

// ConnectTimeoutDefault bounds each connection attempt of a pool opened by Connect (dial, TLS
// and startup) when its configuration sets no connect_timeout, and Connect's first connection.
const ConnectTimeoutDefault = 10 * time.Second

// Connect opens a connection pool for a process whose every statement on it is leash's (a
// dedicated worker process, a CLI), tuned as leash tunes the connections it opens itself: leash's
// session settings are pinned as startup parameters (search_path, the isolation level, UTC, no
// statement timeout; a database's or role's defaults cannot change them), falling back to the
// plain settings when a connection pooler refuses them (PgBouncer does), and TCP keepalive finds a
// dead server in seconds. A cfg without connect_timeout gets ConnectTimeoutDefault. It connects
// once (within ConnectTimeoutDefault) and returns the error when the database cannot be reached.
// cfg is not changed.
//
// An application whose own queries share the pool opens it itself (pgxpool.New): New then
// pins the settings on control connections of its own.
func Connect(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	cfg = cfg.Copy()
	cfg.ConnConfig.DialFunc = netdial.WithKeepAlive(cfg.ConnConfig.DialFunc)
	if targetsPrimary(cfg) {
		// The URL asks for the primary: a connection whose server stopped taking writes (fenced
		// read-only after a failover) is closed when released, and the next one finds the new
		// primary.
		store.DropReadOnly(cfg)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = ConnectTimeoutDefault
	}
	pinned := cfg.Copy()
	store.PinSession(&pinned.ConnConfig.Config)
	db, err := pgxpool.NewWithConfig(ctx, pinned)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, ConnectTimeoutDefault)
	defer cancel()
	err = db.Ping(pctx)
	if store.StartupParamsRefused(err) {
		db.Close()
		if db, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			return nil, fmt.Errorf("open database: %w", err)
		}
		err = db.Ping(pctx)
	}
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("cannot reach the database at %s:%d: %w", cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	return db, nil
}

// targetsPrimary reports whether cfg's URL asks for a server that takes writes
// (target_session_attrs=read-write or primary).
func targetsPrimary(cfg *pgxpool.Config) bool {
	s := cfg.ConnString()
	return strings.Contains(s, "target_session_attrs=read-write") || strings.Contains(s, "target_session_attrs=primary")
}
