package pool

import (
	"context"
	"fmt"
	"time"

	"github.com/leashq/leash/internal/store"
)

// Status is a snapshot of the jobs for operators: counts per queue and state, the job waiting the
// longest, and the running jobs. Ages are measured on the database clock.
type Status struct {
	Counts []StateCount
	// OldestWaiting is the runnable job (run_at passed) that has waited the longest; nil when
	// none waits.
	OldestWaiting *WaitingJob
	// Running lists running jobs, the oldest heartbeat first, up to StatusParams.Running.
	Running []RunningJob
}

// StateCount is the number of jobs of one queue in one state.
type StateCount struct {
	Queue string
	State string
	Count int64
}

// WaitingJob is a runnable job not yet claimed.
type WaitingJob struct {
	ID    int64
	Kind  string
	Queue string
	// Age is how long it has been runnable.
	Age time.Duration
}

// RunningJob is a job under lease.
type RunningJob struct {
	ID           int64
	Kind         string
	Queue        string
	Holder       string // the worker id holding the lease
	Attempt      int
	MaxAttempts  int
	Token        int64 // the lease token
	HeartbeatAge time.Duration
	LeaseLeft    time.Duration // negative once the lease expired
	Revoked      bool
	Progress     string // the last progress reported, as JSON text; empty if none
}

// StatusParams tune ReadStatus.
type StatusParams struct {
	// Running is the most running jobs listed, 1 to ListLimitMax. 0: ListLimitDefault.
	Running int
	// CountFinished counts completed, failed and cancelled jobs too. That reads every row the
	// table keeps (retention decides how many); without it the counts cover queued and running
	// jobs only, read through the indexes that hold them, so the cost follows the backlog. Leave
	// it off for anything that refreshes itself.
	CountFinished bool
}

// ReadStatus reads a Status.
func ReadStatus(ctx context.Context, db DB, p StatusParams) (Status, error) {
	limit, err := listLimit("StatusParams.Running", p.Running)
	if err != nil {
		return Status{}, err
	}
	read := store.ReadLiveStatus
	if p.CountFinished {
		read = store.ReadStatus
	}
	st, err := read(ctx, db, limit)
	if err != nil {
		return Status{}, err
	}
	out := Status{Counts: make([]StateCount, len(st.Counts)), Running: make([]RunningJob, len(st.Running))}
	for i, c := range st.Counts {
		out.Counts[i] = StateCount(c)
	}
	if w := st.OldestWaiting; w != nil {
		out.OldestWaiting = &WaitingJob{ID: w.ID, Kind: w.Kind, Queue: w.Queue, Age: w.Age}
	}
	for i, r := range st.Running {
		out.Running[i] = RunningJob{ID: r.ID, Kind: r.Kind, Queue: r.Queue, Holder: r.Holder, Attempt: int(r.Attempt),
			MaxAttempts: int(r.MaxAttempts), Token: r.Token, HeartbeatAge: r.HeartbeatAge, LeaseLeft: r.LeaseLeft,
			Revoked: r.Revoked, Progress: r.Progress}
	}
	return out, nil
}

// Per-minute statistics (leash.minute_stats) feed charts of throughput, failures, pickup latency
// and queue depth. Someone has to write them: a process calls SampleMinuteStats every few
// seconds (the worker binary does, in every worker; one at a time does the work), and
// ReadMinuteStats reads them back.

// Defaults of MinuteSampleParams.
const (
	// SampleLagDefault is how long after a minute ends it is sampled: outcomes are stamped with
	// their transaction's start time, so a minute's last outcomes may commit a little after it.
	SampleLagDefault = 5 * time.Second
	// SampleBackfillDefault is how many closed minutes a sample fills in at most.
	SampleBackfillDefault = 60
	// SampleRetainDefault is how long sampled minutes are kept.
	SampleRetainDefault = 24 * time.Hour
)

// MinuteSampleParams tune SampleMinuteStats. The zero value gives the defaults.
type MinuteSampleParams struct {
	// Now replaces the database clock (for tests). Zero: now() of the database.
	Now time.Time
	// Lag: a minute is sampled once this long has passed since it ended. 0: SampleLagDefault.
	Lag time.Duration
	// Backfill is the number of closed minutes, the latest first, filled in when they have no
	// row yet. 0: SampleBackfillDefault.
	Backfill int
	// Retain: rows for older minutes are deleted. 0: SampleRetainDefault.
	Retain time.Duration
}

// SampleMinuteStats writes the statistics of every closed minute of the last p.Backfill that has
// none (normally just the minute that ended last) and deletes rows older than p.Retain. One
// process at a time samples: while another does, it returns 0 at once. It returns the number of
// minutes written.
//
// Finished counts and pickup latency are counted from the rows of leash.jobs as they are when
// the minute is sampled, so a minute filled in late misses jobs retention deleted meanwhile, and
// its queue depth is unknown (nil).
func SampleMinuteStats(ctx context.Context, db Beginner, p MinuteSampleParams) (int, error) {
	if p.Lag < 0 || p.Backfill < 0 || p.Retain < 0 {
		return 0, fmt.Errorf("pool: MinuteSampleParams must not be negative")
	}
	return store.SampleMinutes(ctx, db, store.SampleParams(p))
}

// MinuteStats is one minute of statistics.
type MinuteStats struct {
	// Minute starts the minute covered: [Minute, Minute+1m).
	Minute time.Time
	// Sampled: a row exists for the minute. Without one (no process sampled it) every other
	// field is zero.
	Sampled bool
	// Jobs finished in the minute, by final state.
	Completed, Failed, Cancelled int64
	// Started counts the attempts that began in the minute and whose pickup latency the rows
	// still tell; PickupP50 and PickupP99 are the percentiles of that latency (from runnable to
	// claimed), nil when Started is 0.
	Started              int64
	PickupP50, PickupP99 *time.Duration
	// Queued (available or retryable) and Runnable (of those, run_at passed) as read when the
	// minute was sampled, shortly after it ended; nil when it was filled in later.
	Queued, Runnable *int64
}

// ReadMinuteStats returns the last minutes whole minutes (1 to 10080, a week; 0: 60), oldest
// first, ending with the last whole minute. Minutes without a row come with Sampled false.
func ReadMinuteStats(ctx context.Context, db DB, minutes int) ([]MinuteStats, error) {
	if minutes < 0 || minutes > 7*24*60 {
		return nil, fmt.Errorf("pool: minutes must be 0 to %d, got %d", 7*24*60, minutes)
	}
	rows, err := store.ReadMinuteStats(ctx, db, store.ReadStatsParams{Minutes: minutes})
	if err != nil {
		return nil, err
	}
	out := make([]MinuteStats, len(rows))
	for i, r := range rows {
		out[i] = MinuteStats(r)
	}
	return out, nil
}
