package pool

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leashq/leash/internal/store"
)

// claimLoop claims up to the number of free slots until ctx is done. While work flows it claims
// again at once, with up to ClaimsInFlight claims in flight, each for its share of the slots
// (after a claim that took all it asked for, it lets slots free up for at most ClaimGather, so
// that the next claim takes many jobs in one commit); after an empty claim it polls every
// IdlePollInterval, one claim at a time; once it has found nothing for WaitAfter it registers as
// waiting (so that inserts notify it), claims once more to close the race with an insert that
// committed unseen (and again 1, 2, 4, ... 32 ms later, for an insert still committing
// meanwhile), and then waits for a notification, a freed slot or the PollInterval poll, which
// bounds that race. It unregisters as soon as it finds work again. It returns only once every
// claim it started has returned and started its jobs. Its state between claims is a claimState.
func (p *Pool) claimLoop(ctx context.Context) {
	poll := time.NewTimer(p.jitteredPoll())
	defer poll.Stop()
	idle := time.NewTimer(time.Hour)
	idle.Stop()
	defer idle.Stop()
	w := &waiting{p: p}
	defer w.unregister()
	c := &claimsInFlight{results: make(chan claimResult, p.cfg.Engine.ClaimsInFlight)}
	defer c.wait()
	s := claimState{claimNow: true}
	for {
		// Start claims: several while work flows, one at a time otherwise.
		k := s.parallel(p)
		gathering := false
		share := (p.cfg.Concurrency + k - 1) / k // what one claim asks for at most
		for s.claimNow && c.n < k && ctx.Err() == nil && p.keeper.Healthy() {
			free := c.free(p)
			if free <= 0 {
				break
			}
			if gathering = s.gather(free, share, p.cfg.Engine.ClaimGather); gathering {
				break
			}
			free = min(free, share)
			if free -= c.startFrontBeside(ctx, p, free); free > 0 {
				c.start(ctx, p, free)
			}
		}
		if c.n > 0 {
			// Wait for a claim to return, or for a reason to start another.
			var gatherEnd <-chan time.Time
			if gathering {
				idle.Reset(max(time.Until(s.gatherUntil), time.Microsecond))
				gatherEnd = idle.C
			}
			select {
			case <-ctx.Done():
				return
			case r := <-c.results:
				c.done(r)
				if r.err != nil {
					if ctx.Err() != nil {
						return
					}
					p.log.WarnContext(ctx, "claiming jobs failed", slog.Any("err", r.err))
				}
				if s.returned(r) {
					p.gate.found()
					if s.stayWaiting(w.registered, time.Now()) {
						w.rearm(ctx)
					} else {
						w.unregister()
					}
				} else if r.err == nil && !r.busy {
					w.rearm(ctx)
				}
			case <-p.wake:
				s.notified()
			case <-p.slotWake:
				// A waiting loop claims when woken: every job inserted since it registered wakes it.
				s.claimNow = s.claimNow || !w.registered
			case <-poll.C:
				poll.Reset(p.jitteredPoll())
				p.scan.polled()
				if w.registered {
					w.register(ctx)
				}
				s.notified() // claim once the claims in flight return, whatever they found
			case <-gatherEnd:
				s.claimNow = true
			}
			if gathering {
				idle.Stop()
			}
			continue
		}
		full := c.free(p) <= 0
		waited := s.waited(p.cfg.Engine.WaitAfter)
		if !full && !s.failed && waited && !w.registered && time.Now().After(w.retryAt) {
			if w.register(ctx) {
				s.claimNow = true
				continue // claim once more: an insert that did not see the registration is found now
			}
		}
		if w.registered && w.stale() && time.Now().After(w.retryAt) {
			// A queue was paused, resumed or capped since the registration: wait on the queues
			// that may be claimed now (a paused one is not notified, a resumed one is).
			w.register(ctx)
		}
		recheck := s.recheck(p, w, full, waited, gathering)
		if recheck > 0 {
			idle.Reset(recheck)
		}
		claim := true
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
			if w.registered {
				// A waiting loop claims only when woken: start from the front, so that a job
				// ahead of the cursor (a higher priority, an earlier run_at) is found now.
				p.scan.polled()
			}
		case <-p.slotWake:
			// A freed slot calls for a claim only from a loop not waiting for wake-ups: one that
			// waits is woken for every job inserted since it registered, and for its own retries
			// (requeued).
			claim = !w.registered
		case <-idle.C:
		case <-poll.C:
			poll.Reset(p.jitteredPoll())
			p.scan.polled()
			if w.registered {
				// Refresh before it expires; claim unless other waiters claimed for their polls.
				claim = w.polled(ctx)
				if !claim && p.queues.anyPaused(p.cfg.Queues) {
					// The registration leaves paused queues out, so no insert wakes this pool for
					// one resumed while the notification was lost: read the view now, and claim
					// if it changed.
					p.queues.stale.Store(true)
					p.refreshQueues(ctx)
					claim = w.stale()
				}
			}
		}
		s.claimNow, s.woken = claim, false
		if recheck > 0 {
			idle.Stop()
		}
	}
}

// claimState is the claim loop's state between claims. Its transitions: a claim returned
// (returned), a notification came while claims were in flight (notified), slots are about to
// be claimed while jobs wait (gather); and it says how many claims to keep in flight (parallel)
// and when an idle loop claims again (recheck).
type claimState struct {
	idleSince   time.Time // when the last claim found nothing; zero while work flows
	claimNow    bool      // start claims now; false after an empty or failed claim, until a wake-up or timer
	failed      bool      // the last claim failed: wait for a wake-up or the poll
	woken       bool      // a notification arrived while a claim was in flight
	saturated   bool      // the last claim took every slot it asked for: jobs are waiting
	busy        int       // claims in a row that found nothing but a capped queue's row held
	gatherUntil time.Time // when the current gathering of free slots ends; zero when none
	// light: the loop found work while waiting for wake-ups and waits on (see stayWaiting);
	// lightAt is when it last did.
	light   bool
	lightAt time.Time
}

// lightGap is the shortest time between two claims that find work for a waiting loop to go on
// waiting for wake-ups rather than claim on its own: work that comes faster is claimed in
// flight, with no notification per insert.
const lightGap = 10 * time.Millisecond

// stayWaiting decides, after a claim that found work, whether the loop goes on waiting for
// wake-ups (true: it stays registered and re-arms) or works on its own (false: it unregisters
// and claims again at once). It stays while work is light: it was registered, the claim did not
// take every slot it asked for (so nothing more was claimable), and the last such claim was at
// least lightGap ago. Staying saves the claims of the way back to waiting (the polls of
// WaitAfter, the registration's re-checks) for every job of a trickle; an insert committed
// after the claim's snapshot still wakes the loop, as it is registered (sql/019_wake_races.sql).
func (s *claimState) stayWaiting(registered bool, now time.Time) bool {
	stay := registered && !s.saturated && now.Sub(s.lightAt) >= lightGap
	s.light = stay
	if stay {
		s.lightAt = now
		// Claim again only for a notification that came while the claim ran.
		s.claimNow, s.woken = s.woken, false
	}
	return stay
}

// parallel is how many claims to keep in flight: several while work flows, one otherwise.
func (s *claimState) parallel(p *Pool) int {
	if s.idleSince.IsZero() && !s.light && !s.failed && !p.queues.anyCapped() {
		return p.cfg.Engine.ClaimsInFlight
	}
	return 1
}

// gather reports whether to let more slots free up before claiming: jobs are waiting and some
// slots are still busy, so wait (window from the first such moment) for one claim and one
// commit to take many jobs rather than each few.
func (s *claimState) gather(free, share int, window time.Duration) bool {
	if s.saturated && free < share && window > 0 {
		now := time.Now()
		if s.gatherUntil.IsZero() {
			s.gatherUntil = now.Add(window)
		}
		if now.Before(s.gatherUntil) {
			return true
		}
	}
	s.gatherUntil = time.Time{}
	return false
}

// notified records a notification that came while claims were in flight: it may be for a job
// they missed.
func (s *claimState) notified() { s.woken, s.claimNow = true, true }

// returned records what a claim returned and reports whether it found work (the loop then
// stops waiting for notifications).
func (s *claimState) returned(r claimResult) (found bool) {
	switch {
	case r.err != nil:
		// Wait for a wake-up or the poll rather than spin; a notification that came while the
		// claim ran is such a wake-up.
		s.failed, s.saturated = true, false
		s.claimNow, s.woken = s.woken, false
	case r.n > 0:
		s.idleSince, s.failed, s.claimNow, s.busy = time.Time{}, false, true, 0
		s.saturated = r.n == r.limit
		return true
	case r.busy:
		// Another claim of a capped queue holds its row for a few milliseconds: try again soon
		// (backing off while it stays held), without counting as idle.
		s.failed, s.saturated = false, false
		s.busy++
		s.claimNow, s.woken = s.woken, false
	default:
		s.failed, s.saturated, s.busy = false, false, 0
		if s.idleSince.IsZero() {
			s.idleSince = time.Now()
		}
		// A notification that came while the claim ran may be for a job it missed.
		s.claimNow, s.woken = s.woken, false
	}
	return false
}

// waited reports whether the loop has found nothing for at least after.
func (s *claimState) waited(after time.Duration) bool {
	return !s.idleSince.IsZero() && time.Since(s.idleSince) >= after
}

// recheck is how long an idle loop (no claim in flight) waits before claiming again without a
// wake-up; 0: only a wake-up, a freed slot or the poll. full: no slot is free; waited: as waited
// reports; gathering: slots are being let free up.
func (s *claimState) recheck(p *Pool, w *waiting, full, waited, gathering bool) time.Duration {
	switch {
	case gathering:
		return max(time.Until(s.gatherUntil), time.Microsecond)
	case s.busy > 0 && !full && !s.failed:
		return min(max(p.cfg.Engine.IdlePollInterval, time.Millisecond)<<min(s.busy-1, 16), p.cfg.PollInterval)
	case full || s.failed || s.idleSince.IsZero():
		return 0
	case !w.registered && waited:
		// Registering failed: claim and try again when it is due (backing off up to the poll
		// interval), not spin.
		return max(time.Until(w.retryAt), time.Millisecond)
	case !w.registered:
		return p.cfg.Engine.IdlePollInterval
	case w.rechecks < registeredRechecks:
		// Just registered: an insert whose trigger looked for waiters before the registration
		// committed, and that committed after the claim that followed it, sent no notification.
		// Its commit (a WAL flush) takes a few milliseconds: claim again at 1, 2, 4, ... 32 ms
		// rather than leave it to the next poll.
		d := time.Millisecond << w.rechecks
		w.rechecks++
		return d
	}
	return 0
}

// claimResult is what one claim in flight returned.
type claimResult struct {
	limit, n int
	busy     bool // nothing claimed because a capped queue's row was held
	err      error
}

// claimsInFlight tracks the claim loop's claims in flight; only the claim loop uses it.
type claimsInFlight struct {
	n        int // claims in flight
	reserved int // slots they asked for: not free for another claim until they return
	results  chan claimResult
	// A claim from the front running beside the others (see startFrontBeside): the slots it
	// asked for, until it returns, and its goroutine.
	sideReserved atomic.Int64
	side         sync.WaitGroup
}

// start claims up to limit jobs in the background; its result arrives on c.results once the
// jobs it claimed have started.
func (c *claimsInFlight) start(ctx context.Context, p *Pool, limit int) {
	c.n++
	c.reserved += limit
	go func() {
		n, busy, err := p.claim(ctx, limit)
		c.results <- claimResult{limit: limit, n: n, busy: busy, err: err}
	}()
}

// free is how many slots no running job and no claim in flight holds.
func (c *claimsInFlight) free(p *Pool) int {
	// The claim from the front beside the others starts its jobs (active) before it releases its
	// reservation: read the reservation first, so that those jobs are never counted in neither.
	side := int(c.sideReserved.Load())
	return p.cfg.Concurrency - int(p.active.Load()) - c.reserved - side
}

// startFrontBeside starts a claim from the front beside the claims past the cursor when one is
// due and such claims have become slow (see claimScan.besideDue), for half of free (at least 1),
// and returns how many slots it took. It returns 0 when none is due.
func (c *claimsInFlight) startFrontBeside(ctx context.Context, p *Pool, free int) int {
	if free <= 0 {
		return 0
	}
	queue, ok := p.scan.besideDue(p)
	if !ok {
		return 0
	}
	limit := max(free/2, 1)
	c.sideReserved.Add(int64(limit))
	c.side.Add(1)
	go func() {
		defer c.side.Done()
		err := p.claimFrontBeside(ctx, queue, limit)
		c.sideReserved.Add(-int64(limit))
		if err != nil && ctx.Err() == nil {
			p.log.WarnContext(ctx, "claiming jobs from the front failed", slog.String("queue", queue), slog.Any("err", err))
		}
		// Its slots are free again, and it may have taken the cursor back: claim now.
		p.poke(p.slotWake)
	}()
	return limit
}

// done accounts for a returned claim.
func (c *claimsInFlight) done(r claimResult) {
	c.n--
	c.reserved -= r.limit
}

// wait waits for every claim in flight: the jobs they claim are started (and handed back at
// shutdown), never stranded.
func (c *claimsInFlight) wait() {
	for ; c.n > 0; c.n-- {
		<-c.results
	}
	c.side.Wait()
}

// registeredRechecks is how many claims follow a fresh registration at 1, 2, 4, ... ms.
const registeredRechecks = 6

// ownPollEvery: every ownPollEvery-th poll of a waiting loop claims even when other waiters'
// polls cover its queues, so a forged poll time in leash.waiters delays nothing for longer.
const ownPollEvery = 10

// waiting is the claim loop's registration as a worker waiting for work.
type waiting struct {
	p          *Pool
	registered bool
	rechecks   int       // claims made since the registration (see registeredRechecks)
	retryAt    time.Time // after a failed registration, when to try again
	key        string    // the queue view's waitable key at the registration
	polls      int       // polls since the registration
	failing    bool      // the last registration failed (and was warned about)
	failures   int       // registrations failed in a row
}

// registerRetryMin is how soon a failed registration is tried again the first time.
const registerRetryMin = 50 * time.Millisecond

// stale reports whether the queues to wait on have changed in the view since the registration.
func (w *waiting) stale() bool {
	_, key := w.p.queues.waitable(w.p.cfg.Queues)
	return key != w.key
}

// register records (or refreshes) the registration; false when it could not.
func (w *waiting) register(ctx context.Context) bool {
	ok, _ := w.registerFor(ctx, false)
	return ok
}

// polled refreshes the registration at a poll and reports whether the poll should claim: not
// when, within half a poll interval, other waiters of each of the pool's queues claimed for a
// poll of theirs (their claims found what a poll looks for: jobs no notification announced), so
// that an idle fleet claims about twice per poll interval, not once per worker. It always
// claims while the pool's listener is down (wakes may be lost), at every ownPollEvery-th poll,
// and when the refresh fails.
func (w *waiting) polled(ctx context.Context) bool {
	w.polls++
	_, claim := w.registerFor(ctx, true)
	return claim
}

// registerFor is register; atPoll: the refresh is a poll's (see polled), and claim says whether
// it should claim.
func (w *waiting) registerFor(ctx context.Context, atPoll bool) (ok, claim bool) {
	p := w.p
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// Only on the queues not paused: an insert into a paused queue wakes nobody. Expires three
	// polls from now: refreshed at every poll while waiting, gone soon after the worker is.
	queues, key := p.queues.waitable(p.cfg.Queues)
	// Pickable by inserts (see wake.go) only while the listener can hear the wake.
	armed := p.listener.Connected()
	wake := store.Wake{Channel: p.wakeChannel, Slots: p.cfg.Concurrency - int(p.active.Load()), Armed: armed, Poll: atPoll}
	if atPoll && armed && w.polls%p.ownPollEvery != 0 {
		wake.PollWindow = p.cfg.PollInterval / 2
	}
	claim, err := store.RegisterWaker(sctx, p.control(), p.waiterID, queues, 3*p.cfg.PollInterval+time.Second, wake)
	if err != nil {
		if ctx.Err() == nil {
			// Warned once until a registration succeeds again (a row held by a forgotten
			// transaction would fail every one).
			level := slog.LevelDebug
			if !w.failing {
				level = slog.LevelWarn
			}
			p.log.Log(ctx, level, "registering as waiting for work failed; polling instead", slog.Any("err", err))
		}
		// Tried again soon (a lock held for a moment, a vacuum truncating the table), then less
		// and less often, up to once per poll interval.
		w.retryAt = time.Now().Add(min(registerRetryMin<<min(w.failures, 16), p.cfg.PollInterval))
		w.failing = true
		w.failures++
		return false, true
	}
	w.failing, w.failures = false, 0
	if !w.registered {
		w.rechecks, w.polls = 0, 0
	}
	// Not armed: the first claim that finds nothing once the listener is connected (it wakes the
	// claim loop when it connects) arms it.
	p.picked.Store(!armed)
	w.registered, w.key = true, key
	return true, claim
}

// rearm makes the registration pickable again after an insert picked it and the claim that
// followed found nothing (another worker took the job, or the wake was stale or forged). A
// failure leaves it to the next refresh at the poll; meanwhile inserts pick other waiters.
func (w *waiting) rearm(ctx context.Context) {
	p := w.p
	if !w.registered || !p.listener.Connected() || !p.picked.Swap(false) {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := store.RearmWaiter(sctx, p.control(), p.waiterID, p.cfg.Concurrency-int(p.active.Load())); err != nil && ctx.Err() == nil {
		p.log.DebugContext(ctx, "waiting for work again failed; the next poll refreshes the registration", slog.Any("err", err))
	}
}

// unregister removes the registration, if any: a busy worker needs no wake-up.
func (w *waiting) unregister() {
	if !w.registered {
		return
	}
	w.registered = false
	p := w.p
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := store.UnregisterWaiter(ctx, p.control(), p.waiterID); err != nil {
		// It expires on its own; meanwhile inserts notify a worker that is busy, which is harmless.
		p.log.Warn("unregistering as waiting for work failed", slog.Any("err", err))
	}
}

// jitteredPoll is the time to the next poll: between 80% and 100% of PollInterval, never more,
// so that what a poll bounds (a job behind the cursor, a registration's race) is bounded by
// PollInterval as configured.
func jitteredPoll(d time.Duration) time.Duration {
	return d - time.Duration(rand.Int64N(int64(d)/5+1))
}

func (p *Pool) jitteredPoll() time.Duration { return jitteredPoll(p.cfg.PollInterval) }

// claim leases up to limit jobs and starts them: first from each active capped queue, holding
// that queue's row, as much as its cap leaves room for; then from the active uncapped queues in one
// statement (see queues.go). Capped queues go first because they can never take more than their
// room, while the uncapped ones would fill every free slot and starve them. With
// OutcomesWithClaims, outcomes waiting to be written ride along with the uncapped claim: they are
// written in the same transaction, one commit for both. The statements are not cut short by
// ctx: jobs they claim are always started (and handed back on shutdown), never stranded. busy
// reports that a capped queue was passed over because another claim held its row.
func (p *Pool) claim(ctx context.Context, limit int) (n int, busy bool, err error) {
	p.metrics.Claims.Add(1)
	p.refreshQueues(ctx)
	plan := p.queues.plan(p.cfg.Queues)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	claimed := 0
	var firstErr error
	for _, q := range plan.capped {
		if claimed >= limit {
			break
		}
		sentAt := time.Now()
		params := store.ClaimParams{Queues: []string{q}, Limit: limit - claimed, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}
		jobs, err := store.ClaimCapped(sctx, controlDB{p}, params)
		if err != nil {
			// This queue waits for the next round; the others are claimed now.
			if errors.Is(err, store.ErrQueueBusy) {
				busy = true
			} else {
				firstErr = cmp.Or(firstErr, err)
			}
			p.log.DebugContext(ctx, "claiming jobs of a capped queue failed", slog.String("queue", q), slog.Any("err", err))
			continue
		}
		p.startAll(jobs, sentAt)
		claimed += len(jobs)
	}
	for _, q := range plan.rated {
		if claimed >= limit {
			break
		}
		if !p.rates.begin(q, time.Now()) {
			continue // at its limit until its timer wakes the loop, or claimed by another claim of the pool
		}
		sentAt := time.Now()
		params := store.ClaimParams{Queues: []string{q}, Limit: limit - claimed, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}
		jobs, next, err := store.ClaimRated(sctx, controlDB{p}, params)
		p.rates.end(q)
		if err != nil {
			if errors.Is(err, store.ErrQueueBusy) {
				busy = true
			} else {
				firstErr = cmp.Or(firstErr, err)
			}
			p.log.DebugContext(ctx, "claiming jobs of a rate-limited queue failed", slog.String("queue", q), slog.Any("err", err))
			continue
		}
		if next > 0 {
			p.metrics.RateLimited.Add(1)
		}
		p.rates.hold(q, next, func() { p.poke(p.wake) })
		p.startAll(jobs, sentAt)
		claimed += len(jobs)
	}
	for _, q := range plan.keyed {
		if claimed >= limit {
			break
		}
		sentAt := time.Now()
		probe := p.unkeyed.due(q, p.cfg.PollInterval)
		params := store.KeyedParams{Unkeyed: probe,
			ClaimParams: store.ClaimParams{Queues: []string{q}, Limit: limit - claimed, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}}
		jobs, next, err := store.ClaimKeyed(sctx, controlDB{p}, params)
		if err != nil {
			if errors.Is(err, store.ErrQueueBusy) {
				busy = true
			} else {
				firstErr = cmp.Or(firstErr, err)
			}
			p.log.DebugContext(ctx, "claiming jobs of a queue with a per-key limit failed", slog.String("queue", q), slog.Any("err", err))
			continue
		}
		p.unkeyed.record(q, jobs, probe)
		// A key of the queue comes due then (a job scheduled, room again under a rate limit): the
		// loop claims again at that time, without holding the queue back meanwhile.
		p.rates.nudge(q, next, func() { p.poke(p.wake) })
		p.startAll(jobs, sentAt)
		claimed += len(jobs)
	}
	if len(plan.uncapped) > 0 && claimed < limit {
		n, err := p.claimUncapped(sctx, plan.uncapped, limit-claimed)
		if err != nil {
			firstErr = err
		}
		claimed += n
	}
	if claimed > 0 {
		return claimed, false, nil // what was claimed runs; a failed part is tried again next round
	}
	return 0, busy && firstErr == nil, firstErr
}

// claimScan is where the claim loop's index scan of a single queue starts (see
// store.ClaimCursor): past the last job it claimed, except for a claim from the front at least
// every fullEvery, which finds jobs that became runnable before the cursor (a higher priority, a
// run_at in the past, a claim rolled back). Claims in flight at once share it.
type claimScan struct {
	mu       sync.Mutex
	queue    string
	after    *store.ClaimCursor
	lastFull time.Time
	// pollFired: the poll fired since the last claim from the front began, so the next claim
	// starts from the front (see frontDue).
	pollFired bool
	fullCost  time.Duration // how long the last claim from the front took
	side      bool          // a claim from the front runs beside the others
	// gen counts the times a claim from the front beside the others took the cursor back: a
	// claim past the cursor that began before does not move it on.
	gen uint64
	// Tests set these; zero means frontBesideCost and fullEveryFloor.
	besideCost, everyFloor time.Duration
	// passed is where the cursor stood after each recent claim, oldest first: a claim past the
	// cursor looks again at the jobs of the cursor's priority and run_at that the claims of the
	// last cursorLag passed over (see store.ClaimParams.RecheckFromID).
	passed []passedAt
}

type passedAt struct {
	at  time.Time
	pos store.ClaimCursor
}

// cursorLag is how far behind the last job claimed a claim past the cursor starts: in run_at
// within the cursor's priority, and in the claims made since, within its run_at.
const cursorLag = 100 * time.Millisecond

// fullEvery is how often a claim starts from the front: twenty times what such a claim costs,
// so that it takes at most about 5% of the claim loop's time, however many dead index entries an
// old snapshot keeps at the front; at least every 10ms, and at most once per poll interval (the
// poll itself makes one due: see frontDue).
func (sc *claimScan) fullEvery(poll time.Duration) time.Duration {
	return min(max(20*sc.fullCost, cmp.Or(sc.everyFloor, fullEveryFloor)), poll)
}

// polled records that the poll fired: the next claim starts from the front.
func (sc *claimScan) polled() {
	sc.mu.Lock()
	sc.pollFired = true
	sc.mu.Unlock()
}

// frontDue reports whether the next claim starts from the front: fullEvery has passed since the
// last one began, or the poll has fired since. Not the time alone: the poll is jittered, and an
// idle worker claims only when woken or polled, so a poll that came a little sooner than
// fullEvery would leave a job behind the cursor to the poll after (almost two poll intervals).
// With the poll, it waits at most one (jitteredPoll is never longer), plus the claim's own time.
// Called with sc.mu held.
func (sc *claimScan) frontDue(now time.Time, poll time.Duration) bool {
	return sc.pollFired || now.Sub(sc.lastFull) >= sc.fullEvery(poll)
}

// frontBegins records that a claim from the front begins: the poll that made it due is served.
// Called with sc.mu held.
func (sc *claimScan) frontBegins() { sc.pollFired = false }

// frontBesideCost is what a claim from the front must cost before it runs beside the claims past
// the cursor rather than in their place. Below it, a claim from the front every fullEvery stalls
// the claim loop for at most 5% of its time in steps of at most that; above it (dead index
// entries an old snapshot keeps at the front), it would stall the loop for that long at every
// poll interval.
const frontBesideCost = 10 * time.Millisecond

// fullEveryFloor is how often at most a claim starts from the front.
const fullEveryFloor = 10 * time.Millisecond

// beside reports whether claims from the front run beside the claims past the cursor: they have
// become slow, there is one queue to claim, and there is a control connection to spare for them
// (renewals and outcomes keep theirs). Called with sc.mu held.
func (sc *claimScan) beside(p *Pool) bool {
	return sc.fullCost >= cmp.Or(sc.besideCost, frontBesideCost) && !p.cfg.Engine.ClaimFromFront && len(p.cfg.Queues) == 1 &&
		(p.cfg.ControlConns < 0 || p.cfg.ControlConns >= p.cfg.Engine.ClaimsInFlight+3)
}

// besideDue reports whether a claim from the front is due beside the others, and for which
// queue; if so, it is recorded as running.
func (sc *claimScan) besideDue(p *Pool) (string, bool) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.after == nil || sc.side || !sc.beside(p) || !sc.frontDue(time.Now(), p.cfg.PollInterval) {
		return "", false
	}
	sc.side = true
	sc.frontBegins()
	return sc.queue, true
}

// moved records the cursor's position after a claim, and forgets positions it no longer needs:
// those older than the newest one at least cursorLag old. Called with sc.mu held.
func (sc *claimScan) moved(now time.Time) {
	sc.passed = append(sc.passed, passedAt{at: now, pos: *sc.after})
	keep := 0
	for i, p := range sc.passed {
		if now.Sub(p.at) >= cursorLag {
			keep = i
		}
	}
	sc.passed = sc.passed[keep:]
	if len(sc.passed) > 4096 {
		// Thousands of claims within cursorLag: keep the oldest, which bounds the recheck.
		sc.passed = append(sc.passed[:1], sc.passed[len(sc.passed)-2048:]...)
	}
}

// recheckFrom is the id from which a claim past the cursor looks again at jobs of the cursor's
// priority and run_at: where the claims stood cursorLag ago, if they were on that run_at then;
// else 0 (all of them: the cursor came to that run_at within the lag). Called with sc.mu held.
func (sc *claimScan) recheckFrom(now time.Time) int64 {
	if len(sc.passed) == 0 {
		return 0
	}
	p := sc.passed[0]
	if now.Sub(p.at) < cursorLag || p.pos.Priority != sc.after.Priority || !p.pos.RunAt.Equal(sc.after.RunAt) {
		return 0
	}
	return p.pos.ID
}

// claimUncapped claims from queues in one statement, with waiting outcomes when
// OutcomesWithClaims is on.
func (p *Pool) claimUncapped(sctx context.Context, queues []string, limit int) (int, error) {
	params := store.ClaimParams{Queues: queues, Limit: limit, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}
	sc := &p.scan
	single := len(queues) == 1 && !p.cfg.Engine.ClaimFromFront
	sc.mu.Lock()
	gen := sc.gen
	if single && sc.queue == queues[0] && sc.after != nil &&
		(!sc.frontDue(time.Now(), p.cfg.PollInterval) || sc.beside(p)) {
		// Past the last job claimed, and cursorLag behind it within its priority: an insert whose
		// transaction began before that job's (run_at is its transaction's start) but committed
		// after the claim lands just behind it, and is found now rather than at the next claim
		// from the front. The price is a walk over the dead entries of cursorLag's worth of
		// claimed jobs with an earlier run_at; those with the same run_at (a COPY's thousands)
		// are skipped.
		after := *sc.after
		params.After, params.Lag, params.RecheckFromID = &after, cursorLag, sc.recheckFrom(time.Now())
	}
	if single && sc.queue != queues[0] {
		sc.queue, sc.after, sc.passed = queues[0], nil, nil
	}
	if single && params.After == nil {
		sc.frontBegins()
	}
	sc.mu.Unlock()
	began := time.Now()
	var items []finishItem
	var err error
	defer func() {
		// Only a claim from the front that succeeded counts as one: while such claims fail
		// (a statement timeout on a bloated index), every claim goes on trying from the front.
		// Its cost is measured without outcomes riding along.
		if single && params.After == nil && err == nil {
			sc.mu.Lock()
			sc.lastFull = began
			if len(items) == 0 {
				sc.fullCost = time.Since(began)
			}
			sc.mu.Unlock()
		}
	}()
	if p.cfg.Engine.OutcomesWithClaims {
		items = p.takeOutcomes()
	}
	sentAt := time.Now()
	var jobs []store.ClaimedJob
	if len(items) == 0 {
		jobs, err = store.Claim(sctx, p.control(), params)
	} else {
		outs := make([]store.Outcome, len(items))
		for i := range items {
			outs[i] = items[i].out
		}
		var ws []store.Written
		ws, jobs, err = store.FinishAndClaim(sctx, controlDB{p}, outs, params)
		if err != nil {
			// Neither statement committed: write the outcomes the usual way (retried, split
			// when the database refuses one), then report the claim's failure.
			p.flush(items, nil)
			return 0, err
		}
		written := make(map[int64]string, len(ws))
		for _, w := range ws {
			written[w.ID] = w.State
		}
		p.settleAll(items, written)
		p.wakeForFreed(ws)
	}
	if err != nil {
		return 0, err
	}
	if last := store.LastClaimed(jobs); single && last != nil {
		// From the front, the cursor goes to what was found (perhaps back, to a job that became
		// runnable ahead of it); past the cursor, it only moves on. A claim that finds nothing
		// keeps it: nothing runnable is left behind it.
		sc.mu.Lock()
		if params.After == nil || sc.after == nil || (sc.gen == gen && sc.after.Less(*last)) {
			sc.after = last
			sc.moved(time.Now())
		}
		sc.mu.Unlock()
	}
	p.startAll(jobs, sentAt)
	return len(jobs), nil
}

// claimFrontBeside claims up to limit jobs of queue from the front of the index while the
// claims past the cursor go on, and starts them. When it takes all it asked for, more jobs may
// wait behind the cursor (a burst of a higher priority, or of run_at in the past): it takes the
// cursor back to the last of them, so that the claims past the cursor drain the rest at their
// pace rather than this claim at one per poll interval.
func (p *Pool) claimFrontBeside(ctx context.Context, queue string, limit int) error {
	sc := &p.scan
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	params := store.ClaimParams{Queues: []string{queue}, Limit: limit, WorkerID: p.cfg.ID, Lease: p.cfg.LeaseDuration}
	began := time.Now()
	jobs, err := store.Claim(sctx, p.control(), params)
	sc.mu.Lock()
	sc.side = false
	// A failed one (a statement timeout on a bloated index) is tried again after fullEvery, not
	// at once: the claim loop goes on past the cursor meanwhile.
	sc.lastFull = began
	if err == nil {
		sc.fullCost = time.Since(began)
		last := store.LastClaimed(jobs)
		if len(jobs) == limit && last != nil && sc.queue == queue && sc.after != nil && last.Less(*sc.after) {
			sc.after = last
			sc.gen++
			sc.passed = nil
			sc.moved(time.Now())
		}
	}
	sc.mu.Unlock()
	if err != nil {
		return err
	}
	p.startAll(jobs, began)
	return nil
}

// startAll counts and starts the jobs one claim returned; rows it set aside are counted and
// logged, never run.
func (p *Pool) startAll(jobs []store.ClaimedJob, sentAt time.Time) {
	for i := range jobs {
		if jobs[i].SetAside {
			p.metrics.SetAside.Add(1)
			p.log.Warn("job cannot be claimed; failed it instead of running it", slog.Int64("job_id", jobs[i].ID),
				slog.String("queue", jobs[i].Queue), slog.String("kind", jobs[i].Kind), slog.Int("attempt", int(jobs[i].Attempt)))
			continue
		}
		p.metrics.Claimed.Add(1)
		p.start(&jobs[i], sentAt)
	}
}

// takeOutcomes takes the outcomes waiting for the finisher, without waiting.
func (p *Pool) takeOutcomes() []finishItem { return p.appendOutcomes(nil) }

// appendOutcomes appends the outcomes waiting for the finisher to items (up to finishBatch in
// all), without waiting.
func (p *Pool) appendOutcomes(items []finishItem) []finishItem {
	n := min(len(p.finishCh), finishBatch)
	if n == 0 {
		return items
	}
	items = slices.Grow(items, n) // more may come meanwhile: append makes room
	for len(items) < finishBatch {
		select {
		case it := <-p.finishCh:
			items = append(items, it)
		default:
			return items
		}
	}
	return items
}

func (p *Pool) start(cj *store.ClaimedJob, sentAt time.Time) {
	j := newJob(*cj, p.db)
	l := j.lease
	ctx := p.keeper.HoldIn(l, p.jobsCtx, cj.ID, cj.Token, sentAt)
	if d := cmp.Or(cj.Timeout, p.cfg.Timeouts[cj.Kind]); d > 0 {
		// Ends the lease: the handler's context is cancelled with the timeout, and the lease is
		// no longer renewed, so a handler that ignores it is settled by a rescuer.
		j.timer = time.AfterFunc(d, func() {
			if l.End(&timeoutError{d}) {
				p.metrics.TimedOut.Add(1)
				p.log.Warn("job timed out; cancelling", slog.Int64("job_id", j.claim.ID), slog.String("kind", j.claim.Kind),
					slog.Duration("timeout", d))
			}
		})
	}
	p.runningMu.Lock()
	p.running[j.claim.Token] = j
	p.runningMu.Unlock()
	p.active.Add(1)
	p.outcomes.Add(1)
	if p.events.wantsStarts() {
		p.events.emit(true, JobEvent{Queue: j.claim.Queue, Kind: j.claim.Kind, State: store.StateRunning, Pickup: j.pickup()})
	}
	p.runs.Add(1)
	r := run{ctx: ctx, job: j}
	select {
	case p.idle <- r:
	default:
		go p.runner(r)
	}
}

// run is one attempt handed to a runner.
type run struct {
	ctx context.Context
	job *Job
}

// runner runs r, then, as an idle runner, the attempts start hands it, one after the other,
// until Run returns. Handler goroutines are so kept from job to job rather than started for each:
// for a short handler, a goroutine's start and the growth of its stack cost more than the job.
// Runners are about as many as the slots (the claim loop claims no more than the free slots), a
// few more when a freed slot was taken again before its runner was back waiting (a new one
// starts then, and stays): a handler that ignores cancellation keeps its runner, as it keeps its
// slot. A handler that calls runtime.Goexit ends its runner (the attempt is accounted for as
// before); one that locks its goroutine to its thread and leaves it locked leaves the next
// attempts of that runner on that thread. The profiler labels a handler set on its goroutine
// (pprof.SetGoroutineLabels) end with its attempt: the runner takes those of Run's context
// again, which a goroutine started for the next attempt would have had.
func (p *Pool) runner(r run) {
	for {
		p.runOne(r)
		pprof.SetGoroutineLabels(p.runnerLabels)
		select {
		case r = <-p.idle:
		case <-p.done:
			return
		}
	}
}

// labelsOnly returns a context that carries ctx's profiler labels and nothing else, read once at
// Run's start. pprof.SetGoroutineLabels given the jobs' context itself (a context.WithoutCancel)
// would allocate a copy of it on every call, once per job.
func labelsOnly(ctx context.Context) context.Context {
	var kv []string
	pprof.ForLabels(ctx, func(k, v string) bool {
		kv = append(kv, k, v)
		return true
	})
	if len(kv) == 0 {
		return context.Background()
	}
	return pprof.WithLabels(context.Background(), pprof.Labels(kv...))
}

// runOne executes one attempt and frees its slot.
func (p *Pool) runOne(r run) {
	defer func() {
		p.active.Add(-1)
		p.poke(p.slotWake)
		p.runs.Done()
	}()
	p.execute(r.ctx, r.job)
}

// forget ends the job's supervision: no more renewals, no timeout.
func (p *Pool) forget(j *Job) {
	if j.timer != nil {
		j.timer.Stop()
	}
	p.runningMu.Lock()
	if p.running[j.claim.Token] == j {
		delete(p.running, j.claim.Token)
	}
	p.runningMu.Unlock()
	p.keeper.Release(j.lease)
}
