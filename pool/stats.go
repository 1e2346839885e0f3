package pool

// Stats is a snapshot of what a Pool did since New, returned by Pool.Stats: plain counts the
// caller reads (like pgxpool.Pool.Stat), each a total since New except Stalled.
type Stats struct {
	Claimed int64 // attempts started
	// Claims counts the claim loop's claims (one statement per queue kind, however many jobs
	// each took; an idle worker's polls included): Claims per Claimed is what a job costs in
	// claims.
	Claims     int64
	Completed  int64 // attempts that completed their job
	Retried    int64 // attempts that failed and left the job retryable
	Failed     int64 // attempts that failed their job for good
	Cancelled  int64 // attempts that ended with their job cancelled
	HandedBack int64 // jobs handed back at shutdown (available again, no attempt spent)
	// StaleWrites counts outcomes and writes rejected by the lease fence.
	StaleWrites int64
	Panics      int64 // handler panics recovered
	// Stalled is the number of handlers running on after their lease ended, at the last check
	// (a gauge, not a total).
	Stalled int64
	// Abandoned counts jobs left to their lease at shutdown because the handler did not stop.
	Abandoned      int64
	TimedOut       int64 // attempts cancelled by their timeout
	Pruned         int64 // finished jobs deleted by retention
	ScheduledJobs  int64 // jobs this worker enqueued for schedule ticks
	ScheduleErrors int64 // schedules refused (bad spec) or ticks that could not be enqueued
	// RevokedByNotification counts revocations that reached a running job on job_revoked;
	// Lease.RevokedByRenewal and Lease.RevokedByRecheck count the other paths.
	RevokedByNotification int64
	// SetAside counts rows a claim failed instead of leasing, because they cannot be claimed (an
	// attempt counter at the largest integer, which only an SQL client writes).
	SetAside int64
	// RateLimited counts claims of a rate-limited queue (SetQueueRateLimit) that left it at its
	// limit with jobs still to start, or found it there: the pool then passes over the queue until
	// the limit lets it start a job again. Claims per second of a queue kept at its limit.
	RateLimited int64
	// EventsDropped counts job events not delivered to Config.Observer because it fell more than
	// 65,536 events behind.
	EventsDropped int64

	Lease    LeaseStats
	Listener ListenerStats
}

// LeaseStats counts what happened to the pool's leases.
type LeaseStats struct {
	RenewalsSucceeded int64 // leases renewed
	RenewalsFailed    int64 // leases whose renewal statement failed
	RenewalsLost      int64 // leases a renewal found gone (revoked or taken over)
	RenewalsSkipped   int64 // leases not renewed because another transaction held the row
	EndedRevoked      int64 // leases ended by lease.ErrRevoked
	EndedLost         int64 // leases ended by lease.ErrLost
	EndedTimeout      int64 // leases ended by lease.ErrRenewalTimeout
	EndedShutdown     int64 // leases ended by lease.ErrShutdown
	Rescued           int64 // expired leases this worker took back (of any worker's jobs)
	RevokedByRenewal  int64 // revocations found by a regular renewal
	RevokedByRecheck  int64 // revocations found by a re-check after the listener reconnected
}

// ListenerStats counts what the pool's LISTEN connection saw.
type ListenerStats struct {
	Received   int64 // notifications received on any channel
	Malformed  int64 // job_revoked payloads that did not parse
	Reconnects int64 // connections made after the first
	PingsLost  int64 // liveness pings that did not come back in time
	Terminated int64 // server backends of abandoned listener connections that were terminated
	// Wakes counts notifications on the pool's own wake channel (an insert picked it) naming one
	// of its queues; WakesIgnored those naming none (forged or garbage, harmless); WakesHeld
	// notifications held back because the claims after the ones before kept finding nothing.
	Wakes, WakesIgnored, WakesHeld int64
}

// Stats returns a snapshot of the pool's counters. Each count is read atomically, the set of
// them not at one instant.
func (p *Pool) Stats() Stats {
	m := p.metrics
	l, n := &m.Lease, &m.Notify
	return Stats{
		Claims: m.Claims.Load(), Claimed: m.Claimed.Load(), Completed: m.Completed.Load(), Retried: m.Retried.Load(),
		Failed: m.Failed.Load(), Cancelled: m.Cancelled.Load(), HandedBack: m.HandedBack.Load(),
		StaleWrites: m.StaleWrites.Load(), Panics: m.Panics.Load(), Stalled: m.Stalled.Load(),
		Abandoned: m.Abandoned.Load(), TimedOut: m.TimedOut.Load(), Pruned: m.Pruned.Load(),
		ScheduledJobs: m.ScheduledJobs.Load(), ScheduleErrors: m.ScheduleErrors.Load(),
		RevokedByNotification: m.RevokedByNotification.Load(), SetAside: m.SetAside.Load(), RateLimited: m.RateLimited.Load(),
		EventsDropped: p.events.droppedCount(),
		Lease: LeaseStats{
			RenewalsSucceeded: l.RenewalsSucceeded.Load(), RenewalsFailed: l.RenewalsFailed.Load(),
			RenewalsLost: l.RenewalsLost.Load(), RenewalsSkipped: l.RenewalsSkipped.Load(),
			EndedRevoked: l.EndedRevoked.Load(), EndedLost: l.EndedLost.Load(),
			EndedTimeout: l.EndedTimeout.Load(), EndedShutdown: l.EndedShutdown.Load(),
			Rescued: l.Rescued.Load(), RevokedByRenewal: l.RevokedByRenewal.Load(),
			RevokedByRecheck: l.RevokedByRecheck.Load(),
		},
		Listener: ListenerStats{
			Received: n.Received.Load(), Malformed: n.Malformed.Load(), Reconnects: n.Reconnects.Load(),
			PingsLost: n.PingsLost.Load(), Terminated: n.Terminated.Load(),
			Wakes: n.Wakes.Load(), WakesIgnored: n.WakesIgnored.Load(), WakesHeld: n.WakesHeld.Load(),
		},
	}
}
