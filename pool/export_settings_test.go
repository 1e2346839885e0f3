package pool

import "github.com/jackc/pgx/v5/pgxpool"

// ControlPool is the pool the lease protocol runs on, for tests that look at its sessions.
func (p *Pool) ControlPool() *pgxpool.Pool { return p.control() }
