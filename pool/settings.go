package pool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/internal/listener"
	"github.com/leashq/leash/internal/store"
)

// ErrDatabaseSettings is matched (errors.Is) by the error of Run, and of Ready, when the database
// is set up in a way leash cannot work with and cannot override on its connections; errors.As
// with *SettingError says which setting and how to fix it.
var ErrDatabaseSettings = errors.New("database settings leash cannot work with")

// SettingError names a database setting that stops leash from working and the fix.
type SettingError struct {
	Setting string // a parameter name, or what the limit is (e.g. "CONNECTION LIMIT of role worker")
	Value   string
	Problem string // what goes wrong
	Fix     string
}

// Error names the setting, its value, what goes wrong and the fix.
func (e *SettingError) Error() string {
	return fmt.Sprintf("database setting %s = %s: %s; fix: %s", e.Setting, e.Value, e.Problem, e.Fix)
}

// Is makes errors.Is(err, ErrDatabaseSettings) true.
func (e *SettingError) Is(target error) bool { return target == ErrDatabaseSettings }

// resetFix says how to undo setting where pg_settings says it comes from.
func resetFix(s store.Session, st store.Setting, value string) string {
	role, db := pgx.Identifier{s.Role}.Sanitize(), pgx.Identifier{s.Database}.Sanitize()
	set := "RESET " + st.Name
	if value != "" {
		set = fmt.Sprintf("SET %s = %s", st.Name, value)
	}
	switch st.Source {
	case "user":
		return fmt.Sprintf("ALTER ROLE %s %s (then reconnect)", role, set)
	case "database":
		return fmt.Sprintf("ALTER DATABASE %s %s (then reconnect)", db, set)
	case "database user":
		return fmt.Sprintf("ALTER ROLE %s IN DATABASE %s %s (then reconnect)", role, db, set)
	case "configuration file":
		return fmt.Sprintf("change %s in postgresql.conf (or ALTER SYSTEM %s) and reload", st.Name, set)
	}
	return fmt.Sprintf("%s is set by the connection (source %q): remove it from the connection string's options", st.Name, st.Source)
}

// judgeSession returns what in s stops leash from working: a server in recovery, a read-only
// default, triggers switched off, connection limits below need (the connections this worker
// opens with its role and database; 0 skips the check).
func judgeSession(s store.Session, need int) []*SettingError {
	var out []*SettingError
	if s.InRecovery {
		out = append(out, &SettingError{Setting: "pg_is_in_recovery()", Value: "true",
			Problem: "the server is a standby in recovery, where nothing can be written",
			Fix:     "point the connection at the primary"})
	} else if s.ReadOnly {
		st := s.Settings["default_transaction_read_only"]
		out = append(out, &SettingError{Setting: "default_transaction_read_only", Value: cmp.Or(st.Value, "on"),
			Problem: "every transaction is read-only, and claims, renewals and outcomes write",
			Fix:     resetFix(s, st, "")})
	}
	if s.SyncRepWaiting > 0 && s.SyncRepFor >= syncRepStuck && !s.InRecovery {
		st := s.Settings["synchronous_standby_names"]
		out = append(out, &SettingError{Setting: "synchronous_standby_names", Value: fmt.Sprintf("%q", st.Value),
			Problem: "commits wait for a synchronous standby that is not connected (wait_event SyncRep), so no claim, renewal " +
				"or outcome completes and every statement times out; a promoted standby that kept the old primary's setting does this",
			Fix: "connect a standby the setting names, or on this server ALTER SYSTEM SET synchronous_standby_names = '' and " +
				"SELECT pg_reload_conf() (the waiting commits then complete)"})
	}
	if st := s.Settings["session_replication_role"]; st.Value != "" && st.Value != "origin" {
		out = append(out, &SettingError{Setting: "session_replication_role", Value: st.Value,
			Problem: "triggers do not fire in leash's sessions: no insert wakes a waiting worker and a revoked job's failure is not turned into cancelled",
			Fix:     resetFix(s, st, "")})
	}
	if need > 0 {
		limit := func(what string, n int, fix string) {
			if n >= 0 && n < need {
				out = append(out, &SettingError{Setting: what, Value: fmt.Sprint(n),
					Problem: fmt.Sprintf("this worker needs %d connections (its pool's, its control connections and one for LISTEN), and every other worker of the role as many", need),
					Fix:     fix})
			}
		}
		role, db := pgx.Identifier{s.Role}.Sanitize(), pgx.Identifier{s.Database}.Sanitize()
		shrink := "or give the worker fewer connections (the pool's max_conns / WORKER_DB_MAX_CONNS, Config.ControlConns / WORKER_CONTROL_CONNS)"
		limit("CONNECTION LIMIT of role "+s.Role, s.RoleConnLimit, fmt.Sprintf("ALTER ROLE %s CONNECTION LIMIT %d (at least), %s", role, need, shrink))
		limit("CONNECTION LIMIT of database "+s.Database, s.DatabaseConnLimit, fmt.Sprintf("ALTER DATABASE %s CONNECTION LIMIT %d (at least), %s", db, need, shrink))
		limit("max_connections (less those reserved for superusers)", s.ServerLimit, "raise max_connections (a server restart), "+shrink)
	}
	return out
}

// syncRepStuck is how long a commit of the worker's role may wait for a synchronous standby
// before the database counts as unable to take leash's writes: a standby that is there
// acknowledges in milliseconds.
const syncRepStuck = 5 * time.Second

// settingsCheck is the last check of the database's settings: nil when they are fine.
type settingsCheck struct {
	problems []*SettingError
}

// connsNeeded counts the connections this worker opens under the application pool's role and
// database: the pool's, the control connections and the listener's (when it connects as the
// same role to the same database). 0 when the connections go through a pooler, which opens the
// server's connections itself.
func (p *Pool) connsNeeded() int {
	if p.unpinned.Load() {
		return 0
	}
	cc := p.db.Config().ConnConfig
	n := int(p.db.Config().MaxConns)
	if p.cfg.ControlConns > 0 {
		n += p.cfg.ControlConns
	}
	lc := p.cfg.ListenConfig
	if lc == nil || (lc.User == cc.User && lc.Database == cc.Database && lc.Host == cc.Host && lc.Port == cc.Port) {
		n++
	}
	return n
}

// checkSettings reads the database's settings on a control connection and records the problems
// found for Ready. It returns the problems (joined), or the error that kept it from reading them.
func (p *Pool) checkSettings(ctx context.Context) (problem, err error) {
	s, err := store.ReadSession(ctx, p.control())
	if errors.Is(err, store.ErrNotPrimary) && p.control() != p.db {
		// The control connections refuse a standby or a read-only server; the application's
		// pool may still reach it and say why, naming the fix.
		if ps, perr := store.ReadSession(ctx, p.db); perr == nil && (ps.InRecovery || ps.ReadOnly) {
			s, err = ps, nil
		}
	}
	if err != nil {
		return nil, err
	}
	problems := judgeSession(s, p.connsNeeded())
	prev := p.settings.Swap(&settingsCheck{problems: problems})
	errs := make([]error, len(problems))
	for i, e := range problems {
		errs[i] = e
	}
	joined := errors.Join(errs...)
	switch {
	case len(problems) > 0 && (prev == nil || !sameProblems(prev.problems, problems)):
		for _, e := range problems {
			p.log.WarnContext(ctx, "database settings stop this worker", slog.String("setting", e.Setting),
				slog.String("value", e.Value), slog.String("problem", e.Problem), slog.String("fix", e.Fix))
		}
	case len(problems) == 0 && prev != nil && len(prev.problems) > 0:
		p.log.InfoContext(ctx, "database settings no longer stop this worker")
	}
	if prev == nil {
		if unsafe := s.Unsafe(); len(unsafe) > 0 {
			attrs := make([]any, 0, len(unsafe))
			for _, st := range unsafe {
				attrs = append(attrs, slog.String(st.Name, st.Value+" (source "+st.Source+")"))
			}
			p.log.WarnContext(ctx, "these settings of the database or role change what leash does, and leash could not set its own on "+
				"its connections (a pooler that refuses or drops startup parameters, or ControlConns < 0 sharing the application's pool): "+
				"reset them for the worker's role, or connect the worker to PostgreSQL directly (see docs/operations.md, Database settings)", attrs...)
		}
	}
	return joined, nil
}

func sameProblems(a, b []*SettingError) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if *a[i] != *b[i] {
			return false
		}
	}
	return true
}

// watchSettings checks the database's settings again every heartbeat interval, so that Ready
// reports a change (a failover to a standby, a read-only default on new connections) while it
// lasts.
func (p *Pool) watchSettings(ctx context.Context) {
	for sleepCtx(ctx, p.cfg.HeartbeatInterval) {
		sctx, cancel := context.WithTimeout(ctx, p.cfg.HeartbeatInterval)
		p.checkSettings(sctx)
		cancel()
	}
}

// Ready reports why this worker is not ready to work, or nil when it is: the database's
// settings stop it (wrapping ErrDatabaseSettings; checked at start and every heartbeat interval),
// or its LISTEN connection has not connected yet or has been down for longer than a reconnect
// takes (ListenReconnectDelay + PollInterval + 5s). A listener that reconnects within that time
// does not make the worker unready: while it is down, jobs are still claimed by polling.
func (p *Pool) Ready() error {
	if c := p.settings.Load(); c != nil && len(c.problems) > 0 {
		e := c.problems[0]
		return fmt.Errorf("%w: %s = %s", ErrDatabaseSettings, e.Setting, e.Value)
	}
	if p.listener == nil {
		return nil
	}
	down, ever := p.listener.DownFor()
	if !ever {
		return errors.New("listener not connected")
	}
	if grace := p.listenerGrace(); down > grace {
		return fmt.Errorf("listener not connected for %s", down.Round(time.Second))
	}
	return nil
}

// listenerGrace is how long the listener may be down before the worker counts as not ready.
func (p *Pool) listenerGrace() time.Duration {
	return cmp.Or(p.cfg.ListenReconnectDelay, listener.ReconnectDelayDefault) + p.cfg.PollInterval + 5*time.Second
}

// openPinned opens a pool from cc with leash's session settings pinned (store.PinSession). A
// pooler that refuses them (PgBouncer) is found on the first connection: the pool is then opened
// without them, and unpinned is set.
func (p *Pool) openPinned(ctx context.Context, cc *pgxpool.Config) (*pgxpool.Pool, error) {
	pinned := cc.Copy()
	store.PinSession(&pinned.ConnConfig.Config)
	pl, err := pgxpool.NewWithConfig(ctx, pinned)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pl.Ping(pctx); !store.StartupParamsRefused(err) {
		return pl, nil // pinned, or the database is not reachable yet: connections retry later
	}
	pl.Close()
	p.unpinned.Store(true)
	p.log.InfoContext(ctx, "the control connections go through a pooler that refuses session settings; leash uses them unpinned and checks them instead")
	return pgxpool.NewWithConfig(ctx, cc)
}

// checkAtStart refuses settings leash cannot work with before the first claim. A database that
// cannot be reached is left to the claim loop, which waits for it.
func (p *Pool) checkAtStart(ctx context.Context) error {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	problem, err := p.checkSettings(sctx)
	if err != nil {
		p.log.WarnContext(ctx, "could not read the database's settings at start; checking again later", slog.Any("err", err))
		return nil
	}
	if problem != nil {
		return fmt.Errorf("pool: %w", problem)
	}
	return nil
}
