package store

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// SessionParams are the settings every connection leash opens for itself runs with, sent as
// startup parameters so that a database's or role's defaults (ALTER DATABASE ... SET, ALTER
// ROLE ... SET) cannot change what leash's statements mean:
//   - search_path: leash's SQL qualifies its own objects (leash.jobs) but not PostgreSQL's
//     (now(), pg_notify, =); with pg_catalog first nobody who can create in another schema
//     (public, say) can put a function or an operator in their place.
//   - default_transaction_isolation: the claim, the outcome batches and the schedules are
//     written for READ COMMITTED (they re-read a row locked under them); under REPEATABLE READ
//     they fail or, worse, decide on an old snapshot.
//   - statement_timeout, lock_timeout: PostgreSQL's defaults (none); leash bounds its
//     statements with its own contexts, and the waits it wants bounded set their own limit
//     (the waiting hint's lock, migrations' -lock-timeout).
//   - idle_in_transaction_session_timeout: leash never leaves a transaction idle; a minute
//     frees the locks of a process stalled in one.
//   - TimeZone: leash reads and writes timestamps in binary, but the timestamps it writes into
//     JSON (a job's error history) carry the session's offset, and the per-minute statistics
//     cut minutes with date_trunc in the session's zone: UTC keeps both the same on every
//     worker.
//
// PinSession adds two more that depend on the server: idle_session_timeout (PostgreSQL 14 and
// later) is turned off, since the LISTEN connection is idle by design, and synchronous_commit is
// raised to on when it is weaker (off, local, remote_write), since an acknowledged claim or
// outcome must survive a crash; a stronger remote_apply is kept.
var SessionParams = map[string]string{
	"search_path":                         "pg_catalog, pg_temp",
	"default_transaction_isolation":       "read committed",
	"statement_timeout":                   "0",
	"lock_timeout":                        "0",
	"idle_in_transaction_session_timeout": "1min",
	"TimeZone":                            "UTC",
}

// pinAfterConnect is run on each new connection leash opens for itself, after the startup
// parameters: the settings that depend on the server's version or on the value they replace.
const pinAfterConnect = `SELECT
	CASE WHEN current_setting('idle_session_timeout', true) IS NOT NULL
	     THEN set_config('idle_session_timeout', '0', false) END,
	CASE WHEN current_setting('synchronous_commit') IN ('off', 'local', 'remote_write')
	     THEN set_config('synchronous_commit', 'on', false) END`

// PinSession makes cfg's connections run with SessionParams (overriding the same parameters in
// cfg, e.g. a search_path in the connection string) and with idle_session_timeout off and
// synchronous_commit at least on. cfg's own AfterConnect, if any, runs first.
//
// A connection pooler that passes no startup parameters other than its few (PgBouncer) refuses
// such a connection: StartupParamsRefused tells, and the connection is then opened unpinned.
func PinSession(cfg *pgconn.Config) {
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	for k := range cfg.RuntimeParams {
		if _, ok := SessionParams[strings.ToLower(k)]; ok || strings.EqualFold(k, "timezone") {
			delete(cfg.RuntimeParams, k)
		}
	}
	maps.Copy(cfg.RuntimeParams, SessionParams)
	prev := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, c *pgconn.PgConn) error {
		if prev != nil {
			if err := prev(ctx, c); err != nil {
				return err
			}
		}
		if _, err := c.Exec(ctx, pinAfterConnect).ReadAll(); err != nil {
			return fmt.Errorf("pin session settings: %w", err)
		}
		return nil
	}
}

// StartupParamsRefused reports an error of a connection pooler that refuses startup parameters
// it does not know (PgBouncer: "unsupported startup parameter"), i.e. that PinSession cannot
// work through it.
func StartupParamsRefused(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && strings.Contains(pe.Message, "unsupported startup parameter") {
		return true
	}
	return err != nil && strings.Contains(err.Error(), "unsupported startup parameter")
}

// Setting is one of the server's settings as a session sees it.
type Setting struct {
	Name  string
	Value string
	// Source is pg_settings.source: "database", "user" (ALTER ROLE), "database user", "client",
	// "configuration file", "default", ...
	Source string
}

// Session is what a connection found out about the database it works on: the settings leash
// cannot pin and the limits it must fit in.
type Session struct {
	Role, Database string
	Superuser      bool
	InRecovery     bool
	// ReadOnly is transaction_read_only in a transaction of its own: the database's or role's
	// default_transaction_read_only, or a server in recovery.
	ReadOnly bool
	// Settings by name: session_replication_role, default_transaction_read_only,
	// synchronous_commit, synchronous_standby_names, idle_session_timeout (when the server has
	// it) and every name of SessionParams.
	Settings map[string]Setting
	// SyncRepWaiting counts the sessions of this role whose commit is waiting for a synchronous
	// standby (pg_stat_activity wait_event SyncRep) and SyncRepFor is how long the oldest of them
	// has been waiting: a commit that waits for a standby that is not there waits forever.
	SyncRepWaiting int
	SyncRepFor     time.Duration
	// Connection limits: -1 when there is none. ServerLimit is max_connections less the
	// connections reserved for superusers (and, from PostgreSQL 16, reserved_connections) for a
	// role that is not a superuser.
	RoleConnLimit, DatabaseConnLimit, ServerLimit int
}

// ReadSession reads Session on db, in one statement.
func ReadSession(ctx context.Context, db DBTX) (Session, error) {
	s := Session{Settings: map[string]Setting{}}
	names := []string{"session_replication_role", "default_transaction_read_only", "synchronous_commit", "idle_session_timeout", "synchronous_standby_names"}
	for k := range SessionParams {
		names = append(names, strings.ToLower(k))
	}
	var settings [][]string
	var syncRepSecs float64
	err := db.QueryRow(ctx, `
		SELECT session_user::pg_catalog.text, pg_catalog.current_database()::pg_catalog.text, r.rolsuper, pg_catalog.pg_is_in_recovery(),
		       pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on',
		       r.rolconnlimit, d.datconnlimit,
		       CASE WHEN r.rolsuper THEN pg_catalog.current_setting('max_connections')::int
		            ELSE pg_catalog.current_setting('max_connections')::int
		                 OPERATOR(pg_catalog.-) pg_catalog.current_setting('superuser_reserved_connections')::int
		                 OPERATOR(pg_catalog.-) coalesce(pg_catalog.current_setting('reserved_connections', true), '0')::int END,
		       (SELECT pg_catalog.array_agg(ARRAY[s.name, s.setting, s.source]) FROM pg_catalog.pg_settings s
		        WHERE pg_catalog.lower(s.name) OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.text[])),
		       w.n, w.secs
		FROM pg_catalog.pg_roles r, pg_catalog.pg_database d,
		     (SELECT pg_catalog.count(*)::int AS n,
		             coalesce(pg_catalog.max(EXTRACT(epoch FROM pg_catalog.now() OPERATOR(pg_catalog.-) a.query_start)), 0)::float8 AS secs
		      FROM pg_catalog.pg_stat_activity a
		      WHERE a.wait_event OPERATOR(pg_catalog.=) 'SyncRep' AND a.usename OPERATOR(pg_catalog.=) session_user) w
		WHERE r.rolname OPERATOR(pg_catalog.=) session_user AND d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()`,
		names).Scan(&s.Role, &s.Database, &s.Superuser, &s.InRecovery, &s.ReadOnly,
		&s.RoleConnLimit, &s.DatabaseConnLimit, &s.ServerLimit, &settings, &s.SyncRepWaiting, &syncRepSecs)
	if err != nil {
		return Session{}, fmt.Errorf("read the database's settings: %w", err)
	}
	s.SyncRepFor = time.Duration(syncRepSecs * float64(time.Second))
	for _, row := range settings {
		s.Settings[strings.ToLower(row[0])] = Setting{Name: row[0], Value: row[1], Source: row[2]}
	}
	if s.Superuser {
		s.RoleConnLimit, s.DatabaseConnLimit = -1, -1 // neither applies to a superuser
	}
	return s, nil
}

// Unsafe returns the settings of s that change what leash's statements do or how its
// connections behave, among those PinSession pins: found on a session that was not pinned (the
// application's pool, or a pooler that drops startup parameters). Values that merely differ from
// the pinned ones (a search_path without pg_catalog, which is then searched first anyway) are
// not listed.
func (s Session) Unsafe() []Setting {
	var out []Setting
	bad := func(name string, unsafe func(v string) bool) {
		if st, ok := s.Settings[name]; ok && unsafe(st.Value) {
			out = append(out, st)
		}
	}
	bad("search_path", func(v string) bool {
		// pg_catalog is searched first unless the path names it later.
		for i, part := range strings.Split(v, ",") {
			if strings.Trim(strings.TrimSpace(part), `"`) == "pg_catalog" {
				return i > 0
			}
		}
		return false
	})
	bad("default_transaction_isolation", func(v string) bool { return v != "read committed" })
	bad("statement_timeout", func(v string) bool { return v != "0" })
	bad("lock_timeout", func(v string) bool { return v != "0" })
	bad("idle_session_timeout", func(v string) bool { return v != "0" })
	bad("synchronous_commit", func(v string) bool { return v == "off" || v == "local" || v == "remote_write" })
	return out
}
