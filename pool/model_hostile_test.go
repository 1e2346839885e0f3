package pool_test

// Hostile rows in the model: jobs other SQL clients write with values at the edges of what the
// table accepts (attempt counters one claim short of overflowing, timeouts that mix years,
// months, days and microseconds, extreme priorities and timestamps, odd or oversized errors
// histories), and rows written before the table's checks refused them (an attempt counter at
// the largest integer). They live beside the model's jobs, of their own kind, and the rule they
// check is the one that matters for the others: no such row makes a statement fail for the
// other rows. If one did, the model's jobs would stop draining (settle fails) or stall
// (undisturbed jobs, rule 11). Their own end is checked too (checkHostile).

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

const modelHostileKind = "model-hostile"

// mhostile is one hostile row and what its handler runs saw.
type mhostile struct {
	id   int64
	what string // which draw, for messages
	act  string // ok, fail, block (until cancelled: its timeout ends it)
	// setAside: no claim can lease it; it must end failed without running.
	setAside bool
	runs     []error // each run's ending cause (block) or nil
}

// hostileDraw is one row a client may write: the columns and values of its INSERT.
type hostileDraw struct {
	what, cols, vals, act string
}

// hostileDraws are the rows the table accepts. Each "50ms" timeout is 50ms to the table's check
// (30-day months, 24-hour days) and something else entirely with 365.25-day years.
var hostileDraws = []hostileDraw{
	{"attempt one claim short of overflowing", "attempt, max_attempts", "2147483646, 2147483647", "fail"},
	{"attempt one claim short, succeeding", "attempt, max_attempts", "2147483646, 2147483647", "ok"},
	{"max_attempts at the largest integer", "max_attempts", "2147483647", "ok"},
	{"lowest priority", "priority", "32767", "ok"},
	{"highest priority", "priority", "-32768", "ok"},
	{"run_at -infinity", "run_at", "'-infinity'", "ok"},
	{"run_at at the earliest timestamp", "run_at", "'4714-11-24 00:00:00.05+00 BC'", "ok"},
	{"created_at infinity", "created_at", "'infinity'", "ok"},
	{"timeout -1 year 361 days (one day)", "timeout", "'-1 year 361 days'", "ok"},
	{"timeout 50ms as -1 year 361 days -23:59:59.95", "timeout, max_attempts", "'-1 year 361 days -23:59:59.95', 1", "block"},
	{"timeout 50ms as 1 year -359 days -23:59:59.95", "timeout, max_attempts", "'1 year -359 days -23:59:59.95', 1", "block"},
	{"timeout 50ms as -5000000 years 1800000000 days 0.05 s", "timeout, max_attempts", "'-5000000 years 1800000000 days 0.05 seconds', 1", "block"},
	{"timeout 1ms in microseconds", "timeout, max_attempts", "'1 day -86399999000 microseconds', 1", "block"},
	{"errors history an object", "errors, max_attempts", `'{"not": "an array"}', 1`, "fail"},
	{"errors history over 1 MiB", "errors, max_attempts",
		"(SELECT jsonb_agg(md5(i::text) || md5((i + 1)::text)) FROM generate_series(1, 60000) i), 1", "fail"},
}

// addOldRows writes rows the checks of this release refuse, as rows written before them may be:
// the check is dropped for the insert and added back NOT VALID, as the migration adds it. Done
// before the pools start: the ALTERs lock the table.
func (m *model) addOldRows(ctx context.Context) {
	n := 1 + m.hostRng.IntN(3)
	m.sql(ctx, `ALTER TABLE leash.jobs DROP CONSTRAINT jobs_attempt_room_check`)
	for i := range n {
		var id int64
		if err := m.drv.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload, attempt, max_attempts, priority)
			VALUES ($1, '{}', 2147483647, 2147483647, $2) RETURNING id`, modelHostileKind, int16(m.hostRng.IntN(3)-1)).Scan(&id); err != nil {
			m.fatalf("insert an old row: %v", err)
		}
		m.hostile[id] = &mhostile{id: id, what: fmt.Sprintf("old row %d with attempt 2147483647", i), setAside: true}
	}
	m.sql(ctx, `ALTER TABLE leash.jobs ADD CONSTRAINT jobs_attempt_room_check
		CHECK (attempt < 2147483647 OR state NOT IN ('available', 'retryable')) NOT VALID`)
}

// opHostile inserts one row as another client would.
func (m *model) opHostile(ctx context.Context) {
	if m.open(ctx) > 60 {
		return
	}
	m.ops["hostile"]++
	d := hostileDraws[m.hostRng.IntN(len(hostileDraws))]
	var id int64
	m.mu.Lock() // a worker may run it before the insert returns: its handler waits for the entry
	err := m.drv.QueryRow(ctx, `INSERT INTO leash.jobs (kind, payload, `+d.cols+`)
		VALUES ($1, jsonb_build_object('act', $2::text), `+d.vals+`) RETURNING id`, modelHostileKind, d.act).Scan(&id)
	if err == nil {
		m.hostile[id] = &mhostile{id: id, what: d.what, act: d.act}
	}
	m.mu.Unlock()
	if err != nil {
		m.fatalf("insert a hostile row (%s): %v", d.what, err)
	}
}

// handleHostile is every pool's handler of hostile rows.
func (m *model) handleHostile(ctx context.Context, j *pool.Job) error {
	m.mu.Lock()
	h := m.hostile[j.ID]
	m.mu.Unlock()
	if h == nil {
		m.violate(nil, "hostile job %d ran but is not known", j.ID)
		return pool.Permanent(errors.New("unknown hostile job"))
	}
	var cause error
	switch h.act {
	case "fail":
		cause = errors.New("hostile job failed")
	case "block":
		<-ctx.Done()
		cause = context.Cause(ctx)
	}
	m.mu.Lock()
	h.runs = append(h.runs, cause)
	m.mu.Unlock()
	return cause
}

// checkHostile checks how each hostile row ended.
func (m *model) checkHostile(ctx context.Context) {
	rows, err := m.drv.Query(ctx, `SELECT id, state, attempt, lease_token IS NOT NULL, coalesce(last_error, ''),
		jsonb_typeof(errors), errors->0->>'error' FROM leash.jobs WHERE kind = $1`, modelHostileKind)
	if err != nil {
		m.fatalf("read hostile rows: %v", err)
	}
	type hrow struct {
		id                  int64
		state               string
		attempt             int64
		leased              bool
		lastError, errsType string
		firstEntry          *string
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (hrow, error) {
		var x hrow
		return x, r.Scan(&x.id, &x.state, &x.attempt, &x.leased, &x.lastError, &x.errsType, &x.firstEntry)
	})
	if err != nil {
		m.fatalf("read hostile rows: %v", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range got {
		h := m.hostile[r.id]
		if h == nil {
			m.violate(nil, "hostile row %d is not one the test inserted", r.id)
			continue
		}
		v := func(format string, args ...any) {
			m.violate(nil, "hostile job %d (%s): %s", h.id, h.what, fmt.Sprintf(format, args...))
		}
		if r.leased || (r.state != "completed" && r.state != "failed" && r.state != "cancelled") {
			v("not final: state %s, leased %v", r.state, r.leased)
		}
		if r.errsType != "array" && h.act != "" {
			v("errors history is a %s, not an array, after its attempts", r.errsType)
		}
		switch {
		case h.setAside:
			if len(h.runs) > 0 || r.state != "failed" || !strings.Contains(r.lastError, "no room for another claim") {
				v("set aside: %d runs, state %s, last_error %q", len(h.runs), r.state, r.lastError)
			}
		case h.act == "ok":
			if r.state != "completed" {
				v("succeeding job ended %s (%q)", r.state, r.lastError)
			}
		case h.act == "fail":
			if r.state != "failed" || r.lastError != "hostile job failed" {
				v("failing job ended %s with %q", r.state, r.lastError)
			}
			if strings.Contains(h.what, "over 1 MiB") && (r.firstEntry == nil || !strings.HasPrefix(*r.firstEntry, "earlier errors dropped")) {
				v("oversized history kept: first entry %v", r.firstEntry)
			}
		case h.act == "block":
			timedOut := false
			for _, c := range h.runs {
				switch {
				case errors.Is(c, pool.ErrTimeout):
					timedOut = true
				case errors.Is(c, lease.ErrShutdown), errors.Is(c, lease.ErrRenewalTimeout), errors.Is(c, lease.ErrLost):
				default:
					v("blocking job cancelled with %v, not its timeout", c)
				}
			}
			if !timedOut || r.state != "failed" || !strings.HasPrefix(r.lastError, "job timed out after ") {
				v("timeout never ended it: runs %v, state %s, last_error %q", h.runs, r.state, r.lastError)
			}
		}
		if strings.Contains(h.what, "short of overflowing") && r.state != "failed" && r.attempt != 2147483647 {
			v("ran at attempt %d, want 2147483647", r.attempt)
		}
	}
	if len(got) != len(m.hostile) {
		m.violate(nil, "%d hostile rows inserted, %d found", len(m.hostile), len(got))
	}
}
