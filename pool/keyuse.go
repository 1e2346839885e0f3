package pool

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/leashq/leash/internal/store"
)

// KeyUse is one concurrency key of a queue as ReadQueueKeys found it.
type KeyUse struct {
	Key string
	// Holders counts the jobs holding the key: running, or started and waiting to run again.
	Holders int64
	// Waiting counts the key's jobs not yet started that are due now.
	Waiting int64
	// OutOfRate: the key has no room under the queue's per-key rate limit
	// (SetQueueKeyRateLimit); RateWait is how long until it has (0 under a limit of 0, or a start
	// recorded more than a year ahead: not in sight).
	OutOfRate bool
	RateWait  time.Duration
}

// KeyCountCap bounds the counts of ReadQueueKeys and JobsWaitingOnKeyLimit: a key's Holders and
// Waiting are counted up to it, and a count equal to it means at least that many.
const KeyCountCap = 1000

// KeysLooked bounds the keys ReadQueueKeys and JobsWaitingOnKeyLimit look at, per queue and per
// source: the first KeysLooked keys (in key order) that jobs hold, the first KeysLooked keys (in
// key order) with jobs not yet started, and the first KeysLooked keys in the order the queue's
// claims walk them (the keys next in line).
const KeysLooked = 100

// QueueKeys is a bounded look at the concurrency keys of a queue (ReadQueueKeys).
type QueueKeys struct {
	// MaxRunningPerKey is the queue's per-key limit; nil: it has none, and AtLimit is empty.
	MaxRunningPerKey *int
	// AtLimit are the keys held by as many jobs as the limit allows (or more, after the limit was
	// lowered), most jobs waiting first: their due jobs wait for a holder to finish.
	AtLimit []KeyUse
	// KeyRateLimit is the queue's per-key rate limit (starts per KeyRatePeriod); nil: it has
	// none, and OutOfRate is empty.
	KeyRateLimit  *int
	KeyRatePeriod time.Duration
	// OutOfRate are the keys with no room under the per-key rate limit, most jobs waiting first:
	// their due jobs wait for the window to pass.
	OutOfRate []KeyUse
	// Busiest are the keys with the most jobs waiting, most first, with their holders.
	Busiest []KeyUse
	// Looked is how many keys were looked at: at most 3×KeysLooked.
	Looked int
}

// ReadQueueKeys looks at the concurrency keys of queue: which are at the queue's per-key limit
// (SetQueueMaxRunningPerKey), which have the most jobs waiting; at most top of each. It is
// bounded whatever the number of the queue's jobs and keys: it looks at no more than 3×KeysLooked
// keys (the first ones, in key order, that jobs hold or that have jobs not yet started, and the
// ones next in line to be claimed)
// and counts each one's jobs up to KeyCountCap, on the indexes of migration 025 only. A key
// outside those may be missing: the lists are a view of the keys that matter now, not a census.
func ReadQueueKeys(ctx context.Context, db DB, queue string, top int) (QueueKeys, error) {
	if err := checkQueueName(queue); err != nil {
		return QueueKeys{}, err
	}
	rows, err := store.QueueControls(ctx, db, []string{queue})
	if err != nil {
		return QueueKeys{}, err
	}
	uses, err := store.ReadKeyUse(ctx, db, queue, KeysLooked, KeyCountCap)
	if err != nil {
		return QueueKeys{}, err
	}
	row := rows[queue]
	qk := QueueKeys{MaxRunningPerKey: row.MaxRunningPerKey, KeyRateLimit: row.KeyRateLimit, KeyRatePeriod: row.KeyRatePeriod,
		Looked: len(uses)}
	byWaiting := func(a, b store.KeyUse) int {
		return cmp.Or(cmp.Compare(b.Waiting, a.Waiting), cmp.Compare(b.Holders, a.Holders), cmp.Compare(a.Key, b.Key))
	}
	slices.SortFunc(uses, byWaiting)
	for _, u := range uses {
		ku := KeyUse(u)
		if qk.MaxRunningPerKey != nil && u.Holders >= int64(*qk.MaxRunningPerKey) && len(qk.AtLimit) < top {
			qk.AtLimit = append(qk.AtLimit, ku)
		}
		if u.OutOfRate && len(qk.OutOfRate) < top {
			qk.OutOfRate = append(qk.OutOfRate, ku)
		}
		if u.Waiting > 0 && len(qk.Busiest) < top {
			qk.Busiest = append(qk.Busiest, ku)
		}
	}
	return qk, nil
}

// JobsWaitingOnKeyLimit counts, for each of queues that has a per-key limit, the due jobs not yet
// started of its keys at their limit: jobs that would start but for the limit. It looks at the
// keys ReadQueueKeys does and counts as it does (bounded: a lower bound on a queue with more
// keys at their limit than KeysLooked, or more than KeyCountCap jobs waiting on one key). Queues
// without a per-key limit are absent.
func JobsWaitingOnKeyLimit(ctx context.Context, db DB, queues []string) (map[string]int64, error) {
	return jobsHeldBack(ctx, db, queues, func(row store.QueueControl) bool { return row.MaxRunningPerKey != nil },
		func(row store.QueueControl, u store.KeyUse) bool { return u.Holders >= int64(*row.MaxRunningPerKey) })
}

// JobsWaitingOnKeyRate counts, for each of queues that has a per-key rate limit
// (SetQueueKeyRateLimit), the due jobs not yet started of its keys with no room under it: jobs
// that would start but for the limit. It looks and counts as JobsWaitingOnKeyLimit does (a lower
// bound beyond KeysLooked keys or KeyCountCap jobs of one key). Queues without a per-key rate
// limit are absent.
func JobsWaitingOnKeyRate(ctx context.Context, db DB, queues []string) (map[string]int64, error) {
	return jobsHeldBack(ctx, db, queues, func(row store.QueueControl) bool { return row.KeyRateLimit != nil },
		func(_ store.QueueControl, u store.KeyUse) bool { return u.OutOfRate })
}

// jobsHeldBack counts, for each of queues whose row has the limit (limited), the waiting jobs of
// the keys it holds back (held), on the bounded look of store.ReadKeyUse.
func jobsHeldBack(ctx context.Context, db DB, queues []string, limited func(store.QueueControl) bool,
	held func(store.QueueControl, store.KeyUse) bool) (map[string]int64, error) {
	rows, err := store.QueueControls(ctx, db, queues)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64)
	for name, row := range rows {
		if !limited(row) {
			continue
		}
		uses, err := store.ReadKeyUse(ctx, db, name, KeysLooked, KeyCountCap)
		if err != nil {
			return nil, err
		}
		var n int64
		for _, u := range uses {
			if held(row, u) {
				n += u.Waiting
			}
		}
		out[name] = n
	}
	return out, nil
}
