package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/leashq/leash/internal/store"
)

// Queue control (leash.queues). A paused queue is claimed by no worker; a capped queue has at most
// MaxRunning jobs running at once across all workers. A queue without a row is active and
// uncapped. The database is the authority: every claim takes the queue's row itself (FOR SHARE,
// or FOR UPDATE for a capped queue), and a change to the row waits for the claims holding it, so
// a pause or a lowered cap binds from its commit, whatever a worker believes. A pool creates the
// rows of its queues that are missing (active, uncapped) before it claims them. Workers keep a
// view of the rows only to route claims (capped queues are claimed one queue and one claim at a
// time) and to skip paused queues without a query; the view is re-read when
// a queue_changed notification arrives, after each reconnect of the listener and at least once
// per PollInterval, so a lost notification costs at most one poll interval of latency.

// QueueState is a queue's control row and its unfinished jobs.
type QueueState struct {
	Name string
	// PausedAt is when the queue was paused; nil while it is active.
	PausedAt *time.Time
	// MaxRunning caps the queue's running jobs across all workers; nil: no cap.
	MaxRunning *int
	// MaxRunningPerKey limits how many jobs of one concurrency key hold the key at once across
	// all workers; nil: no per-key limit.
	MaxRunningPerKey *int
	// RateLimit limits the queue's job starts to this many in any window of RatePeriod across
	// all workers (SetQueueRateLimit); nil: no rate limit.
	RateLimit  *int
	RatePeriod time.Duration
	// KeyRateLimit limits the starts of the jobs of each concurrency key to this many in any
	// window of KeyRatePeriod across all workers (SetQueueKeyRateLimit); nil: no per-key rate
	// limit.
	KeyRateLimit  *int
	KeyRatePeriod time.Duration
	// Available counts jobs waiting to run (available or retryable, now or later).
	Available int64
	// Running counts jobs running now.
	Running int64
}

// PauseQueue pauses a queue across every worker: once it has committed, no worker starts a job of
// the queue (it waits for the claims of the queue in flight, which then start theirs, and later
// claims read the pause); running jobs go on. It is
// durable: the queue stays paused through restarts until ResumeQueue. It reports whether the
// queue was active before.
func PauseQueue(ctx context.Context, db DB, name string) (bool, error) {
	if err := checkQueueName(name); err != nil {
		return false, err
	}
	return store.PauseQueue(ctx, db, name)
}

// ResumeQueue lets workers claim from a paused queue again, at once. It reports whether the
// queue was paused.
func ResumeQueue(ctx context.Context, db DB, name string) (bool, error) {
	if err := checkQueueName(name); err != nil {
		return false, err
	}
	return store.ResumeQueue(ctx, db, name)
}

// SetQueueMaxRunning caps the number of the queue's jobs running at once across all workers; a
// negative max removes the cap. It binds every worker from its commit (it waits for the claims of
// the queue in flight, and later claims read it); jobs already running over a lowered cap go on,
// and no new one starts until the queue is under it.
func SetQueueMaxRunning(ctx context.Context, db DB, name string, max int) error {
	if err := checkQueueName(name); err != nil {
		return err
	}
	var cap *int
	if max >= 0 {
		cap = &max
	}
	return store.SetQueueMaxRunning(ctx, db, name, cap)
}

// SetQueueMaxRunningPerKey limits the jobs of one concurrency key (InsertOpts.ConcurrencyKey) of
// the queue to max holding the key at once across all workers, through leash.set_queue_max_running_per_key;
// a negative max removes the limit. A job holds its key from its first start until it is finished:
// while it runs, and while it waits to run again (a retry after an error, a snooze, a hand-back at
// shutdown, a rescue after its worker died). With 1 a key is sequential: its jobs run one after
// the other in the key's (priority, run_at, id) order. It binds every worker of this release from
// its commit (it waits for the claims of the queue in flight); jobs already holding a key over a
// lowered limit go on. Workers of releases before it ignore the limit. Jobs without a key are
// limited only by the queue's pause and MaxRunning.
func SetQueueMaxRunningPerKey(ctx context.Context, db DB, name string, max int) error {
	if err := checkQueueName(name); err != nil {
		return err
	}
	var limit *int
	if max >= 0 {
		limit = &max
	}
	return store.SetQueueMaxRunningPerKey(ctx, db, name, limit)
}

// ListQueues returns every queue that has a control row or unfinished jobs, by name.
func ListQueues(ctx context.Context, db DB) ([]QueueState, error) {
	rows, err := store.ListQueues(ctx, db)
	if err != nil {
		return nil, err
	}
	out := make([]QueueState, len(rows))
	for i, r := range rows {
		out[i] = QueueState{Name: r.Name, PausedAt: r.PausedAt, MaxRunning: r.MaxRunning, MaxRunningPerKey: r.MaxRunningPerKey,
			RateLimit: r.RateLimit, RatePeriod: r.RatePeriod, KeyRateLimit: r.KeyRateLimit, KeyRatePeriod: r.KeyRatePeriod,
			Available: r.Available, Running: r.Running}
	}
	return out, nil
}

func checkQueueName(name string) error {
	if name == "" || utf8.RuneCountInString(name) > 128 || !validName(name) {
		return fmt.Errorf("pool: queue name must be 1 to 128 characters of valid UTF-8 without NUL, got %q", truncateForError(name))
	}
	return nil
}

func truncateForError(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", "\uFFFD"), "\uFFFD")
}

// queueView is the pool's view of leash.queues for its own queues.
type queueView struct {
	stale    atomic.Bool // re-read before the next claim
	ensuring atomic.Bool // missing rows are being created (ensureMissing)

	mu     sync.Mutex
	rows   map[string]store.QueueControl
	readAt time.Time // zero until the first successful read
	turn   int       // rotates which capped queue is claimed first
}

// claimPlan is what one claim round asks for: the active uncapped queues in one statement, then
// the active capped ones, those with a rate limit (rated) and those with a per-key limit (keyed,
// whatever their rate limit) each under its row's lock.
type claimPlan struct {
	uncapped, capped, rated, keyed []string
}

// plan splits queues by the view. Paused queues are left out.
func (v *queueView) plan(queues []string) claimPlan {
	v.mu.Lock()
	defer v.mu.Unlock()
	var cp claimPlan
	for _, q := range queues {
		row, ok := v.rows[q]
		switch {
		case !ok:
			cp.uncapped = append(cp.uncapped, q)
		case row.Paused():
		case row.Keyed():
			cp.keyed = append(cp.keyed, q)
		case row.RateLimit != nil:
			cp.rated = append(cp.rated, q)
		case row.MaxRunning != nil:
			cp.capped = append(cp.capped, q)
		default:
			cp.uncapped = append(cp.uncapped, q)
		}
	}
	if n := len(cp.capped); n > 1 {
		v.turn++
		k := v.turn % n
		cp.capped = append(cp.capped[k:], cp.capped[:k]...)
	}
	return cp
}

// waitable returns the queues of queues a worker may wait for work on by the view (those not
// paused), and a key that changes whenever that set, or which of them are capped, changes.
func (v *queueView) waitable(queues []string) ([]string, string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]string, 0, len(queues)) // never nil: none is an empty array, not NULL
	var key strings.Builder
	for _, q := range queues {
		row := v.rows[q]
		if row.Paused() {
			continue
		}
		out = append(out, q)
		key.WriteString(q)
		if row.MaxRunning != nil {
			key.WriteString("\x00capped")
		}
		if row.Keyed() {
			key.WriteString("\x00keyed")
		}
		if row.RateLimit != nil {
			key.WriteString("\x00rated")
		}
		key.WriteByte(0xff) // never in a queue name (valid UTF-8)
	}
	return out, key.String()
}

// anyCapped reports whether any of the pool's queues is capped in the view.
func (v *queueView) anyCapped() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, row := range v.rows {
		if (row.MaxRunning != nil || row.Keyed()) && !row.Paused() {
			return true
		}
	}
	return false
}

// anyPaused reports whether any of queues is paused in the view.
func (v *queueView) anyPaused(queues []string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, q := range queues {
		if v.rows[q].Paused() {
			return true
		}
	}
	return false
}

// paused reports the view's paused flag for each of queues.
func (v *queueView) paused(queues []string) map[string]bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make(map[string]bool, len(queues))
	for _, q := range queues {
		out[q] = v.rows[q].Paused()
	}
	return out
}

// refreshQueues re-reads the view when a notification or reconnect marked it stale, or when it
// is older than the poll interval. A failed read keeps the old view: claims check the rows
// themselves, so the worst a stale view does is delay a resumed queue until the next read.
func (p *Pool) refreshQueues(ctx context.Context) {
	v := &p.queues
	v.mu.Lock()
	due := v.readAt.IsZero() || time.Since(v.readAt) >= p.cfg.PollInterval
	v.mu.Unlock()
	if !v.stale.Swap(false) && !due {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rows, err := store.QueueControls(sctx, p.control(), p.cfg.Queues)
	if err == nil && len(rows) < len(p.cfg.Queues) {
		p.ensureMissing(ctx, rows)
	}
	if err != nil {
		if ctx.Err() == nil && !errors.Is(err, context.Canceled) {
			p.log.WarnContext(ctx, "reading queue controls failed; keeping the last view", slog.Any("err", err))
		}
		v.stale.Store(true)
		return
	}
	v.mu.Lock()
	prev := v.rows
	v.rows, v.readAt = rows, time.Now()
	v.mu.Unlock()
	for _, q := range p.cfg.Queues {
		was, now := prev[q], rows[q]
		if was.Paused() != now.Paused() {
			p.log.InfoContext(ctx, "queue "+map[bool]string{true: "paused", false: "resumed"}[now.Paused()], slog.String("queue", q))
		}
	}
}

// ensureMissing creates, in the background, the rows of the pool's queues that rows lacks:
// claims take a queue only through its row. Creating a row may wait (up to 100ms, for a row
// another client is inserting), so it is never on the claim path: the queues that have rows are
// claimed meanwhile. Once it is done the view is read again and the claim loop woken.
func (p *Pool) ensureMissing(ctx context.Context, rows map[string]store.QueueControl) {
	var missing []string
	for _, q := range p.cfg.Queues {
		if _, ok := rows[q]; !ok {
			missing = append(missing, q)
		}
	}
	if !p.queues.ensuring.CompareAndSwap(false, true) {
		return // one at a time; the next refresh tries again
	}
	go func() {
		defer p.queues.ensuring.Store(false)
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := store.EnsureQueues(sctx, p.control(), missing); err != nil && ctx.Err() == nil {
			p.log.WarnContext(ctx, "creating the rows of the pool's queues failed; tried again at the next read",
				slog.Any("queues", missing), slog.Any("err", err))
		}
		p.queues.stale.Store(true)
		p.poke(p.wake)
	}()
}

// onQueueChanged handles a queue_changed notification (any payload: it only triggers a re-read;
// "*" concerns every queue).
func (p *Pool) onQueueChanged(name string) {
	if name == "*" || slices.Contains(p.cfg.Queues, name) { // "*": the table was truncated
		p.queues.stale.Store(true)
		p.rates.clear() // a rate limit may have changed
		p.poke(p.wake)
	}
}

// QueuesPaused reports, for each of the pool's queues, whether the pool's last read of
// leash.queues found it paused.
func (p *Pool) QueuesPaused() map[string]bool { return p.queues.paused(p.cfg.Queues) }
