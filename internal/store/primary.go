package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNotPrimary is matched (errors.Is) by the error of a connection that RefuseStandby refused.
var ErrNotPrimary = errors.New("server cannot take writes")

// NotPrimaryError is why RefuseStandby refused a server.
type NotPrimaryError struct {
	InRecovery bool // pg_is_in_recovery(): a standby, or a demoted primary
	ReadOnly   bool // transaction_read_only: default_transaction_read_only on (a fenced old primary), or in recovery
}

// Error says what the server is.
func (e *NotPrimaryError) Error() string {
	if e.InRecovery {
		return "server is in recovery (a standby): leash connects only to the primary"
	}
	return "server is read-only (default_transaction_read_only): leash connects only to a writable primary"
}

// Is makes errors.Is(err, ErrNotPrimary) true.
func (e *NotPrimaryError) Is(target error) bool { return target == ErrNotPrimary }

// checkPrimary runs before leash's session settings are pinned: it qualifies what it calls.
const checkPrimary = `SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.current_setting('transaction_read_only')`

// RefuseStandby makes cfg refuse, while it connects, a server that cannot take leash's writes:
// one in recovery (a standby, a demoted primary, a replica behind stale DNS) or read-only by
// default. pgx then tries the next host of a multi-host URL, as with
// target_session_attrs=read-write, so a worker finds the promoted standby on its own; with no
// such host the connection fails with a *NotPrimaryError. cfg's own ValidateConnect (which
// target_session_attrs sets) runs first.
//
// A connection that "works" on a standby is worse than none: every write fails, and a LISTEN
// there never hears a notification sent on the primary.
func RefuseStandby(cfg *pgconn.Config) {
	prev := cfg.ValidateConnect
	cfg.ValidateConnect = func(ctx context.Context, c *pgconn.PgConn) error {
		if prev != nil {
			if err := prev(ctx, c); err != nil {
				return err
			}
		}
		res, err := c.Exec(ctx, checkPrimary).ReadAll()
		if err != nil {
			return fmt.Errorf("check that the server is a primary: %w", err)
		}
		if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 2 {
			return errors.New("check that the server is a primary: unexpected result")
		}
		row := res[0].Rows[0]
		e := &NotPrimaryError{InRecovery: string(row[0]) == "t", ReadOnly: string(row[1]) == "on"}
		if e.InRecovery || e.ReadOnly {
			return e
		}
		return nil
	}
}

// Writable reports whether conn's server still takes writes, as far as the server has told the
// connection: PostgreSQL 14 and later report in_hot_standby and default_transaction_read_only
// whenever they change (a promotion; a failover manager fencing the old primary with
// ALTER SYSTEM SET default_transaction_read_only and a reload), after the next statement.
// Older servers report neither, and every connection counts as writable.
func Writable(conn *pgconn.PgConn) bool {
	return conn.ParameterStatus("in_hot_standby") != "on" && conn.ParameterStatus("default_transaction_read_only") != "on"
}

// DropReadOnly makes cfg's pool destroy, instead of handing out, a connection whose server no
// longer takes writes (Writable): its statements would fail with read_only_sql_transaction
// (25006) for as long as it lived, while the next connection finds the new primary. It is checked
// when the connection is acquired, from what the server last reported (no round trip), and the
// statement is then run on another connection. It is not an AfterRelease hook: pgxpool runs
// those in a goroutine of their own at every release, which cost the claim loop half its
// throughput. cfg's own PrepareConn runs first.
func DropReadOnly(cfg *pgxpool.Config) {
	prev := cfg.PrepareConn
	if cfg.ConnConfig.ValidateConnect == nil {
		// A new connection is refused on such a server too (from what it reported at startup),
		// so that the retry on another connection cannot loop on it.
		cfg.ConnConfig.ValidateConnect = func(_ context.Context, c *pgconn.PgConn) error {
			if !Writable(c) {
				return &NotPrimaryError{InRecovery: c.ParameterStatus("in_hot_standby") == "on", ReadOnly: true}
			}
			return nil
		}
	}
	cfg.PrepareConn = func(ctx context.Context, c *pgx.Conn) (bool, error) {
		if prev != nil {
			if ok, err := prev(ctx, c); !ok || err != nil {
				return ok, err
			}
		}
		return Writable(c.PgConn()), nil
	}
}
