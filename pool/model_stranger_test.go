package pool_test

// A stranger in the model: a role with USAGE on schema leash and no other grant, on a connection
// of its own, that takes every advisory lock an earlier release waited for (a capped queue's
// claim key, the waiting hint's key, the statistics refresh's key) and holds them for random
// stretches, through the end of the chaos and the drain, and tries what it may not do: lock a
// queue's row, the waiting hint's row, read the schedules, the waiters or the queues, refresh the
// statistics. Nothing it does may stop or slow the pools: if it could, the model's jobs would not
// drain (settle fails) or would stall (undisturbed jobs, rule 11); and each thing it may not do
// must be refused.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// mstranger is the model's role without grants and its connection.
type mstranger struct {
	conn *pgx.Conn
	rng  *rand.Rand // its own stream: the model's other draws replay as before
	held bool
}

// strangerLocks are the advisory locks workers of earlier releases waited for, and that of the
// planner-statistics refresh, which is tried, never waited for.
const strangerLocks = `SELECT pg_advisory_lock(1818583411, hashtext('default')), pg_advisory_lock(30510766707210100),
	pg_advisory_lock(30510766707204462)`

// strangerRefused are statements a role without grants must not be able to run.
var strangerRefused = []string{
	`SELECT FROM leash.queues q FOR SHARE`,
	`SELECT FROM leash.queues q FOR UPDATE`,
	`SELECT FROM leash.waiting_hint_lock FOR UPDATE`,
	`SELECT * FROM leash.schedules`,
	`SELECT * FROM leash.waiters`,
	`SELECT * FROM leash.queues`,
	`SELECT leash.refresh_jobs_stats()`,
	`SELECT leash.pause_queue('default')`,
	`UPDATE leash.jobs SET priority = priority`,
}

// opStranger lets the stranger take or release its locks, or try one thing it may not do.
func (m *model) opStranger(ctx context.Context) {
	s := m.strangerConn(ctx)
	m.ops["stranger"]++
	switch w := s.rng.IntN(3); {
	case w == 0 && !s.held:
		if _, err := s.conn.Exec(ctx, strangerLocks); err != nil {
			m.fatalf("the stranger takes its advisory locks: %v", err)
		}
		s.held = true
	case w == 0:
		if _, err := s.conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`); err != nil {
			m.fatalf("the stranger releases its advisory locks: %v", err)
		}
		s.held = false
	default:
		sql := strangerRefused[s.rng.IntN(len(strangerRefused))]
		_, err := s.conn.Exec(ctx, sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42501" {
			m.violate(nil, "a role without grants ran %s: %v (want insufficient_privilege)", sql, err)
		}
	}
}

// strangerConn creates the stranger on first use: a role with USAGE on schema leash only, and a
// connection of its own acting as it.
func (m *model) strangerConn(ctx context.Context) *mstranger {
	if m.stranger != nil {
		return m.stranger
	}
	role := fmt.Sprintf("stranger_%d", uint64(m.seed)%1e12)
	for _, sql := range []string{"DROP ROLE IF EXISTS " + role, "CREATE ROLE " + role + " NOLOGIN", "GRANT USAGE ON SCHEMA leash TO " + role} {
		if _, err := m.drv.Exec(ctx, sql); err != nil {
			m.fatalf("%s: %v", sql, err)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, m.drv.Config().ConnConfig.Copy())
	if err != nil {
		m.fatalf("connect the stranger: %v", err)
	}
	if _, err := conn.Exec(ctx, "SET ROLE "+role); err != nil {
		m.fatalf("SET ROLE %s: %v", role, err)
	}
	m.t.Cleanup(func() {
		conn.Close(context.Background())
		m.drv.Exec(context.Background(), "DROP OWNED BY "+role)
		m.drv.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	m.stranger = &mstranger{conn: conn, rng: rand.New(rand.NewPCG(uint64(m.seed), 0x1ea5+5))}
	return m.stranger
}
