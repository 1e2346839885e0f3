package faults_test

import (
	"context"
	"fmt"
	"time"
)

// checkOpts says what a scenario allows.
type checkOpts struct {
	// handbacks: graceful shutdowns hand jobs back without counting an attempt, so executions
	// may exceed attempts.
	handbacks bool
	// frozen: a worker process was stopped (SIGSTOP); it cannot stop its handlers while frozen,
	// so "stopped before the takeover" is not expected of it.
	frozen bool
}

// check verifies DESIGN's invariants from the database, the ledger and the workers' execution
// logs, after the scenario healed and drained.
func (h *harness) check(o checkOpts) {
	h.t.Helper()
	ctx := context.Background()
	// Every committed job reached a final state, and nothing still holds a lease.
	if n := h.count(`SELECT count(*) FROM leash.jobs WHERE state NOT IN ('completed', 'failed', 'cancelled') OR lease_token IS NOT NULL`); n != 0 {
		h.t.Errorf("%d jobs not final", n)
	}
	// No job completed twice: at most one effect per job.
	if n := h.count(`SELECT count(*) FROM (SELECT job_id FROM ledger GROUP BY job_id HAVING count(*) > 1) d`); n != 0 {
		h.t.Errorf("%d jobs have more than one committed effect", n)
	}
	// Effects exist only for completed jobs, and every completed job of a fenced kind has one.
	if n := h.count(`SELECT count(*) FROM ledger l JOIN leash.jobs j ON j.id = l.job_id WHERE j.state <> 'completed'`); n != 0 {
		h.t.Errorf("%d effects committed for jobs that did not complete", n)
	}
	if n := h.count(`SELECT count(*) FROM leash.jobs j WHERE j.kind IN ('ledger', 'deaf') AND j.state = 'completed'
		AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.job_id = j.id)`); n != 0 {
		h.t.Errorf("%d completed jobs without their effect", n)
	}
	// No effect under a stale token: none was written by a claim that was taken over.
	if n := h.count(`SELECT count(*) FROM ledger l JOIN leash.jobs j ON j.id = l.job_id
		WHERE EXISTS (SELECT 1 FROM jsonb_array_elements(j.errors) e WHERE (e->>'token')::bigint = l.token)`); n != 0 {
		h.t.Errorf("%d effects committed under a token that had been taken over", n)
	}

	// Executions: one per claim at most, and no more than the claims made.
	attempts := map[int64]int{}
	rescuedAt := map[[2]int64]time.Time{}
	rows, err := h.db.Query(ctx, `
		SELECT j.id, j.attempt, (e->>'token')::bigint, (e->>'at')::timestamptz
		FROM leash.jobs j LEFT JOIN LATERAL jsonb_array_elements(j.errors) e ON e ? 'token'`)
	if err != nil {
		h.t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var attempt int
		var token *int64
		var at *time.Time
		if err := rows.Scan(&id, &attempt, &token, &at); err != nil {
			h.t.Fatal(err)
		}
		attempts[id] = attempt
		if token != nil {
			rescuedAt[[2]int64{id, *token}] = *at
		}
	}
	rows.Close()
	starts := map[int64]int{}
	seen := map[[2]int64]bool{}
	for _, e := range h.events() {
		key := [2]int64{e.Job, e.Token}
		switch e.Ev {
		case "start":
			if seen[key] {
				h.t.Errorf("job %d ran twice under token %d", e.Job, e.Token)
			}
			seen[key] = true
			starts[e.Job]++
		case "end":
			// A worker cut off stops its handler before the lease can expire: before any
			// rescuer took that claim back.
			if !o.frozen {
				if at, ok := rescuedAt[key]; ok && !time.Unix(0, e.At).Before(at) {
					h.t.Errorf("job %d token %d: handler stopped at %s, after the takeover at %s",
						e.Job, e.Token, time.Unix(0, e.At).Format(time.StampMicro), at.Format(time.StampMicro))
				}
			}
		}
	}
	for id, n := range starts {
		if !o.handbacks && n > attempts[id] {
			h.t.Errorf("job %d executed %d times in %d claims", id, n, attempts[id])
		}
	}
}

// stats summarises a scenario for its log line.
func (h *harness) stats() string {
	var completed, failed, cancelled, retried, effects int
	h.db.QueryRow(context.Background(), `SELECT
		count(*) FILTER (WHERE state = 'completed'), count(*) FILTER (WHERE state = 'failed'),
		count(*) FILTER (WHERE state = 'cancelled'), count(*) FILTER (WHERE attempt > 1),
		(SELECT count(*) FROM ledger) FROM leash.jobs`).Scan(&completed, &failed, &cancelled, &retried, &effects)
	return fmt.Sprintf("completed=%d failed=%d cancelled=%d reclaimed=%d effects=%d", completed, failed, cancelled, retried, effects)
}
