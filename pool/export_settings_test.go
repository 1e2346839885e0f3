package pool

import "github.com/jackc/pgx/v5/pgxpool"

// ControlPool is the pool the lease protocol runs on, for tests that look at its sessions.
func (p *Pool) ControlPool() *pgxpool.Pool { return p.control() }

// SetOwnPollEvery makes every n-th poll of a waiting p claim even when other waiters' polls
// cover its queues (ownPollEvery); call it before Run.
func (p *Pool) SetOwnPollEvery(n int) { p.ownPollEvery = n }
