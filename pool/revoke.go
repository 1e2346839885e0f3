package pool

import (
	"context"
	"log/slog"
	"time"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/notify"
)

// onRevoked handles a job_revoked notification on the listener's goroutine: it must not block,
// so database work goes to its own goroutine.
func (p *Pool) onRevoked(r notify.Revocation) {
	l := p.lookup(r.ID, r.Token)
	if l == nil || l.Cause() != nil || l.Finishing() {
		return // not ours, an earlier claim, or already ending
	}
	if p.cfg.RevokeRequireRow || r.Takeover {
		// Trust only the row: one renewal statement re-checks every lease and ends revoked or
		// lost ones with the right cause. A takeover is always checked so, since anyone who can
		// connect can send one: a forged takeover costs one early renewal, not a duplicate run.
		p.keeper.Kick(false)
		return
	}
	reason := store.CleanText(r.Reason, store.MaxReasonBytes)
	if reason == "" {
		reason = defaultRevokeReason
	}
	if !l.End(&revocation{reason: reason}) {
		return
	}
	p.metrics.RevokedByNotification.Add(1)
	p.log.Info("job revoked by notification; cancelling", slog.Int64("job_id", r.ID), slog.Int64("lease_token", l.Token),
		slog.String("reason", reason))
	// Make it durable in the row at once, fenced by our token (the cancelled outcome records it
	// too, whichever lands first). A revocation sent by revoke_job is already there: the write
	// changes nothing. At most a few run at once; beyond that the outcome records it.
	select {
	case p.marks <- struct{}{}:
	default:
		return
	}
	go func() {
		defer func() { <-p.marks }()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := store.MarkRevoked(ctx, controlDB{p}, r.ID, l.Token, reason); err != nil {
			p.log.Warn("recording revocation failed", slog.Int64("job_id", r.ID), slog.Any("err", err))
		}
	}()
}
